"""What course_utils.process_group's rendezvous relies on in torch, pinned by a real torchrun.

Should a torch upgrade change any of it, this test fails with the reason,
rather than a training job hanging or dialling a dead rank after a restart.
"""

import textwrap

from course_utils.launch import run_command, torchrun_command


def test_torchrun_serves_a_store_that_outlives_a_worker_restart(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent("""
        import datetime, os, sys
        import torch.distributed as dist
        from course_utils.process_group.rendezvous import agent_store_in_use, attempt_prefix

        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        # a client of the agent's store at MASTER_ADDR:MASTER_PORT: rank 0 serves none of its own
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=20))
        print(f"attempt={attempt} agent_store={agent_store_in_use(os.environ)} prefix={attempt_prefix(os.environ)} "
              f"earlier_keys={store.check(['left-by-attempt-0'])}", flush=True)
        if attempt == "0":
            store.set("left-by-attempt-0", "1")
            sys.exit(3)  # the agent restarts the worker group
    """))
    run = run_command([*torchrun_command(1), "--max-restarts=1", str(script)], timeout_s=120, echo=False)
    lines = [line for line in run.lines if line.startswith("attempt=")]
    assert lines[0].startswith("attempt=0 agent_store=True prefix=course/attempt_0"), run.output[-3000:]
    assert lines[1].startswith("attempt=1 agent_store=True prefix=course/attempt_1"), \
        "the restarted workers must see a grown TORCHELASTIC_RESTART_COUNT:\n" + run.output[-3000:]
    # the restarted group meets in the same store, next to the dead group's keys: hence one prefix per attempt
    assert lines[1].endswith("earlier_keys=True"), run.output[-3000:]
