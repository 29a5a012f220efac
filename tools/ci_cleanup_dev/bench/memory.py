"""``python -m ci_cleanup_dev.bench.memory URL REDIS_URL JOB``: one job's service over its candidates, and its peaks."""

import json
import resource
import sys
import tracemalloc

import redis
from sqlalchemy import create_engine

from ..batches import BY_NAME

if __name__ == "__main__":
    url, redis_url, name = sys.argv[1:4]
    engine, client = create_engine(url), redis.Redis.from_url(redis_url)
    with engine.connect():
        pass  # connect and import before measuring: the peak is the run's own
    tracemalloc.start()
    # No collection forced between batches: a worker's own garbage collector decides, as in production.
    rows = BY_NAME[name].job(engine, client, lambda: None)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    maxrss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"rows": rows, "peak_kib": peak / 1024, "maxrss_kib": maxrss_kib}))
