"""NIXL's tensor cases with torch itself, through the venv's `nixl` (kvrail's compat
package, installed by run.sh): non-contiguous tensors give None, contiguous ones a list of
their memory, as in NIXL."""

import os
import uuid

import pytest

torch = pytest.importorskip("torch")


def test_tensors_as_nixl_takes_them():
    from nixl._api import nixl_agent, nixl_agent_config

    import nixl

    assert os.path.isfile(os.path.join(os.path.dirname(nixl.__file__), "KVRAIL_NIXL_COMPAT")), nixl.__file__
    a = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=[], kvrail_config={"backend": "tcp", "listen": "127.0.0.1:0"}))
    t = torch.arange(8).reshape(2, 4)
    assert a.get_reg_descs(torch.transpose(t, 0, 1)) is None
    assert a.get_xfer_descs(torch.transpose(t, 0, 1)) is None
    assert a.get_xfer_descs([t, torch.transpose(t, 0, 1)]) is None
    x = a.get_xfer_descs([t, t[1]])
    assert x.descCount() == 2 and x[0] == (t.data_ptr(), 64, 0) and x[1] == (t[1].data_ptr(), 32, 0)
    reg = a.register_memory(t)
    assert reg.descCount() == 1
    a.deregister_memory(reg)
