"""Start-up: how ``ddl.init()`` finds its job and what it hands the runtime.

bootstrap (ddlrun, an mpi4py communicator, MPI or Slurm variables, or nothing), mpi,
rendezvous (one node started without mpi4py), coordinator (the daemon a worker starts
under MPI), embedded (a size-1 job's in-process coordinator), start (what start-up hands
the runtime).
"""
