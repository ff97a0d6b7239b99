"""Pipeline parallelism: schedules as tables (``schedules``) and one SPMD runtime that runs them (``runtime``)."""
