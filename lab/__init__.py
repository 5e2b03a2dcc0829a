"""Offline tools around the app: studies, comparisons, figures, deployment set-up.

Nothing here runs inside the ServerApp or ClientApp, and none of it ships in the FAB.
"""
