"""``xlaserve top``: the operator's terminal dashboard of a worker (docs/top.md).

:mod:`tui.status` turns the worker's ``WatchStatus`` snapshots into rows, rates and events (pure);
:mod:`tui.connection` talks to the worker control API; :mod:`tui.app` is the Textual app. Only
``tui.app`` imports Textual, so ``xlaserve top --once`` works without starting it.
"""
