"""Starting ranks: `command` builds the launch line users run (deepspeed's runner); `supervisor` is
`python -m trainer launch`, which starts this node's ranks itself and keeps the preemption promise."""
