"""One agent driven from several Python threads at once (calls release the GIL)."""
import threading

import numpy as np

from conftest import loopback_agent, wait_done


def test_threads_share_an_agent():
    a, b = loopback_agent(), loopback_agent()
    n_threads, blocks, block = 4, 64, 1024
    src = (np.arange(n_threads * blocks * block) % 253).astype(np.uint8)
    dst = np.zeros_like(src)
    a.register_memory(src)
    b.register_memory(dst)
    a.add_remote_agent(b.get_agent_metadata())
    errors = []

    def worker(t):
        try:
            base = t * blocks * block
            rows = [(base + i * block, block, 0) for i in range(blocks)]
            local = a.prep_xfer_dlist("", [(src.ctypes.data + o, n, d) for o, n, d in rows])
            remote = a.prep_xfer_dlist(b.name, [(dst.ctypes.data + o, n, d) for o, n, d in rows])
            for i in range(50):
                x = a.make_prepped_xfer("WRITE", local, [i % blocks], remote, [i % blocks])
                a.transfer(x)
                wait_done(a, x)
                a.release_xfer_handle(x)
            batch = a.batch()
            batch.make_many("WRITE", local, np.arange(blocks, dtype=np.uint32).reshape(8, 8),
                            remote, np.arange(blocks, dtype=np.uint32).reshape(8, 8))
            a.flush(batch)
            batch.raise_first()
            made = batch.handles()
            for h in made[made != 0]:
                wait_done(a, int(h))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert (dst == src).all()
