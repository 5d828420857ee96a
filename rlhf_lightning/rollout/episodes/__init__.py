"""Episodes: the harness that drives envs, chat/turn assembly, stepping in workers."""
