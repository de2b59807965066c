"""L8's bench."""
BENCH = ()
bench_work = None
