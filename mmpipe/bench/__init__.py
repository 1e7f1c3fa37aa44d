"""`mmpipe bench`: run a sweep of training variants, each a separate launcher run, plus peers
(a transformers LLaVA loop, torch.distributed.pipelining), and report them side by side."""
