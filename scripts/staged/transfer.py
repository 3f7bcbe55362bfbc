"""Load transfer alone, demo KV shape: 8 layers x 24 keys, K/V 8 KiB each per block per layer
(16 KiB per layer per block), torch f32 caches [2, 256, 16, 4, 32]. Times LoadJob.run() on this
thread (no compute, prefetch unbounded) for read_layers_per_range k = 1, 2, 4, 8."""
import statistics, sys, time
import numpy as np, torch
from layerkv.bench.backends import open_backends
from layerkv.objects.header import Header
from layerkv.objects.layout import CacheLayout
from layerkv.store.checked import CheckedStore
from layerkv.transfer.load import LoadJob, LoadKey
from layerkv.transfer.staged import StagedLayers

L, NB, KEYS, REPS = 8, 256, 24, int(sys.argv[1]) if len(sys.argv) > 1 else 30
caches = {f"model.layers.{l}.attn": torch.zeros(2, NB, 16, 4, 32) for l in range(L)}
layout = CacheLayout.from_caches(caches, NB, max_transfer_bytes=16 << 20)
header = Header(bytes(16), layout)
hashes = [bytes([i]) * 32 for i in range(KEYS)]
src = np.random.default_rng(0).integers(0, 255, (KEYS, layout.object_nbytes), dtype=np.uint8)
header.encode_into(src, np.arange(KEYS), hashes)
with open_backends(with_mooncake=True) as backends:
    for be in backends:
        store = CheckedStore(be.store, max_batch_keys=64)
        keys = [f"stagedbench-{be.name}-{i}" for i in range(KEYS)]
        store.register_buffer(src.ctypes.data, src.nbytes)
        assert store.batch_put_from(keys, [src.ctypes.data + i * src.strides[0] for i in range(KEYS)], [layout.object_nbytes] * KEYS) == [0] * KEYS
        for ptr, n in {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in caches.values()}:
            store.register_buffer(ptr, n)
        for k in (1, 2, 4, 8):
            staged = StagedLayers(layout, k) if k > 1 else None
            rows = np.zeros((KEYS, staged.row_nbytes if staged else layout.header_nbytes), dtype=np.uint8)
            store.register_buffer(rows.ctypes.data, rows.nbytes)
            times, calls, ranges = [], 0, 0
            for rep in range(REPS):
                for t in caches.values():
                    t.zero_()
                assert store.batch_get_session_start(keys) == [0] * KEYS
                lk = [LoadKey(key, h, 10 + i, (), frozenset({"r"})) for i, (key, h) in enumerate(zip(keys, hashes))]
                job = LoadJob(lk, store=store, layout=layout, header=header, staging=rows, prefetch_layers=64,
                              on_done=lambda j: None, on_failed=lambda ks, why: print("FAILED", why), staged=staged)
                t0 = time.perf_counter(); job.run(); times.append(time.perf_counter() - t0)
                store.batch_get_session_end(keys)
                calls = job.range_calls
                assert not job.failed.any()
            # verify bytes of the last rep
            for l in range(L):
                for e, ent in enumerate(layout.layers[l]):
                    got = caches[f"model.layers.{l}.attn"][e, 10:10 + KEYS].reshape(KEYS, -1).view(torch.uint8).numpy()
                    assert np.array_equal(got, src[:, ent.object_offset:ent.object_offset + ent.block_nbytes])
            store.unregister_buffer(rows.ctypes.data)
            med = statistics.median(times)
            per_key = 1 + 2 * L if k == 1 else len(staged.groups)
            kv = KEYS * (layout.object_nbytes - layout.header_nbytes)
            print(f"{be.name:16s} k={k}: range calls {calls}, ranges/key {per_key} ({per_key / L:.2f}/layer), "
                  f"median {med * 1e3:.2f} ms, p10 {np.percentile(times, 10) * 1e3:.2f} ms, {kv / med / 1e9:.2f} GB/s", flush=True)
        store.unregister_buffer(src.ctypes.data)
        store.batch_remove(keys)
