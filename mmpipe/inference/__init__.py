"""After training: KV-cached generation (`mmpipe generate`) and held-out evaluation."""
