"""The pipeline engine: schedules, partitions, transport, migration and the stage runtime."""
