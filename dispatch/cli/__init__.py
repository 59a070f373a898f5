"""The command line: `python -m dispatch` and the `dispatch` script (commands.py), explain's and the GPU
table's rendering, the environment table and the log switch. The top wing: it imports every other one
and nothing imports it."""
