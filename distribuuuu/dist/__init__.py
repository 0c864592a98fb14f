"""Launch detection, process groups, peers, Slurm and spawn."""
