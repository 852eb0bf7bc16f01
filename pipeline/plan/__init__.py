"""Pure planning: values in, values out, no messages and no side effects.

Costs of ops (``costs``), the exact partitioner (``partition``), which split each step takes
(``planners``), schedules as data (``schedule``), the event replay of a schedule
(``simulate``) and who owns which op (``placement``). Nothing here imports
``torch.distributed``; the runtime parts beside this package do the moving.
"""
