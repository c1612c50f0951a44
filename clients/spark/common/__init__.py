"""What the Spark estimators share (Horovod's ``horovod.spark.common``): the
:mod:`store <ddl.spark.common.store>` their data and runs live in."""
