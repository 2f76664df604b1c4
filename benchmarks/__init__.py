"""xlaserve's benchmark scripts. They belong to the checkout, not to the installed package: they
build their models from ``examples/`` and some reuse ``tests/``.

Run each from the checkout's root as a module, after ``pip install -e ".[test]"``::

    python -m benchmarks.peers_bench --help

``-m`` puts the checkout's root on ``sys.path``, which is how ``benchmarks``, ``examples`` and
``tests`` import one another. ``docs/benchmarks.md`` records the commands and their numbers. The
load generator they drive, ``xlaserve bench`` (:mod:`xlaserve.bench.loadgen`), ships with the
package.
"""
