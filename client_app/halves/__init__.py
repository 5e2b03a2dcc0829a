"""Each algorithm's client half, one module per algorithm (:class:`base.ClientHalf`).

The ClientApp (:mod:`client_app.app`) lists them in one table and calls, around the
task's own train and evaluate, the hooks of those a message activates.
"""
