"""The README's Python example, whole: two kvrail.nixl agents in one process, a NIXL program
with its import swapped. tools/check-front-door.sh checks that every line of the README's
example is here, in order; python/tests/test_readme_example.py runs it."""

import time

import numpy as np

from kvrail.nixl import nixl_agent, nixl_agent_config  # was: from nixl._api import ...

p = nixl_agent("prefill", nixl_agent_config(backends=["UCX"]))
d = nixl_agent("decode", nixl_agent_config(backends=["UCX"]))
kv, src = np.zeros(1 << 20, np.uint8), np.full(1 << 20, 7, np.uint8)
def mem(a):  # NIXL's descriptor tuples: (address, length, device id)
    return [(a.ctypes.data, a.nbytes, 0)]
p.register_memory([m + ("",) for m in mem(kv)], "DRAM")
d.register_memory([m + ("",) for m in mem(src)], "DRAM")
peer = d.add_remote_agent(p.get_agent_metadata())
h = d.initialize_xfer("WRITE", d.get_xfer_descs(mem(src), "DRAM"), p.get_xfer_descs(mem(kv), "DRAM"), peer, b"req-1 done")
d.transfer(h)
while d.check_xfer_state(h) == "PROC":
    time.sleep(0.001)
assert d.check_xfer_state(h) == "DONE"
notes = {}
for _ in range(10000):
    notes = p.get_new_notifs()
    if notes:
        break
    time.sleep(0.001)
assert notes == {"decode": [b"req-1 done"]}, notes
assert (kv == 7).all(), "every byte landed"
d.release_xfer_handle(h)
print("README example: 1 MiB written, the notification after it")
