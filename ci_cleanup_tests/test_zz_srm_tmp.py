from ci_cleanup_tests.test_stale_runner_machines_cleanup import *
import ci_cleanup_tests.test_stale_runner_machines_cleanup as t
from ci_cleanup_tests import conftest

def test_msgs(stack, engine, redis_client):
    for bad in ({"sub_batch_size": 1, "max_deletions": 100_000}, {"sub_batch_size": 0}):
        r = run_job(stale_runner_machines_cleanup, stack, run_config=run_config(**bad), raise_on_error=False)
        f = next(e for e in r.all_events if e.event_type_value in ("STEP_FAILURE", "RUN_FAILURE"))
        print(bad, f.event_type_value, f.node_name, (f.step_failure_data.error.cause.message if f.step_failure_data and f.step_failure_data.error.cause else f.message)[:300])

def test_conc(engine):
    stale_machines(engine, 600)
    import threading
    res = [None, None]; b = threading.Barrier(2)
    def run(i):
        b.wait(); res[i] = service.delete_stale_runner_managers(engine, S, now=utc_now(), sub_batch_limit=20)
    ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    [x.start() for x in ts]; [x.join() for x in ts]
    print(res)
