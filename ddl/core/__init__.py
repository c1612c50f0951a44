"""The small core shared by workers, the launcher and the coordinator daemon: errors, configuration, authentication, limits, dtypes and reduction plans, fusion rule, reports."""
