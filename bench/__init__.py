"""fastcast benchmarks: pytest-benchmark suites (``bench_*.py``) and their runner.

Run everything with ``make bench`` (``python -m bench.run``); see ``bench/run.py`` for
the conventions a benchmark module follows.
"""
