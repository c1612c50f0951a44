"""Start-up: bootstrap (ddlrun, MPI, Slurm, single process), MPI, node rendezvous, the embedded/local coordinator."""
