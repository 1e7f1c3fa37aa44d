"""Where the ranks run: hostfiles over ssh, Slurm batch scripts and their environment, preemption, ports."""
