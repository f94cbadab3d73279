"""`python -m trainer report`: runs' metrics.jsonl drawn as one figure (PNG, or HTML with a table of final values).

`runs` reads and checks the files (through trainer.files) -> `figure` draws them (matplotlib, imported only
here) -> `cli` is the command and writes the output atomically.
"""
