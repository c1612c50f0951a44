"""The small core that every ddl process shares: the workers, the launcher and the
coordinator daemon (``ddl.server`` imports nothing of ddl but this and the stubs).

errors (the typed exceptions), config (every ``DDL_*`` variable and its default), auth
(the job secret, handshakes), limits, keepalive, report (fatal-error records ddlrun reads),
pdeathsig and process_group (children die with their parent; stopping a process group),
dtypes and reduction (names and sizes on the wire; how each reduction travels and is
finished), fusion (the Tensor Fusion rule), cache_signature (the response cache's key),
faults (test-only fault injection). Modules here import only each other.
"""
