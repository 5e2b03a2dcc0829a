"""The deployment runtime: what runs beside Flower on a SuperNode's machine.

Flower 1.41 starts a new ``flwr-clientapp`` process (a new interpreter importing
PyTorch and the app) for every message, and its SuperNode loop sleeps a fixed 3 s
after every pull that brings no message; neither is an option. The warm executor
(``deploy.superexec``) forks each message's process from one that imported
everything once. The SuperNode launcher (``deploy.supernode``) shortens the waits
by swapping the ``time`` module that Flower's ``start_client_internal`` sees, the
only way to change them without editing Flower, and only after checking that the
loop's source is the one it was written against. Not shipped in the FAB.
"""
