"""Before a run: what each layer costs, where the stages are cut, and `mmpipe plan`."""
