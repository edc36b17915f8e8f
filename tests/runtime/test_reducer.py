"""``GradientReducer``: buckets launched during the backward pass give the same gradients, bit for
bit, as buckets launched after it.

Two ranks of a pure data-parallel plan run in two threads of this process on real gloo groups
(``inprocess.run_ranks``) through the runtime's executor; small buckets make
gpt3_tiny several buckets per rank. With overlap every bucket (the tied weight's too) has been
launched by the time the backward pass returns; without, none has; the reduced gradients are
identical either way and on both ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from inprocess import run_ranks

from oobleck.data import GlobalBatchSampler, build_dataset
from oobleck.layer_state import layer_state
from oobleck.models.spec import model_spec
from oobleck.runtime.executor import StepContext, run_schedule, sync_gradients
from testing import hand_plan, template, tiny_config

pytestmark = pytest.mark.slow  # starts processes

BUCKET_BYTES = 64 << 10  # gpt3_tiny's blocks are ~200 KB: several buckets per group


def reduce_once(overlap: bool, generation: int, store: dist.TCPStore) -> list[dict]:
    cfg = tiny_config()
    job = cfg.job
    spec = model_spec(cfg.model, int(job.seed))
    everything = template([(0, spec.num_layers, 0, 0, 1)])
    plan = hand_plan(
        [(everything, (0,), 4), (everything, (1,), 4)], batch=16, micro=2, layers=spec.num_layers, f=1, gpus=1
    )
    dataset = build_dataset(job, cfg.model)
    sampler = GlobalBatchSampler(len(dataset), int(job.global_batch_size), int(job.seed))

    def rank(topology, comm) -> dict:
        layers = {i: layer_state(spec, job, i, "cpu") for i in topology.assignment.layers}
        ctx = StepContext(
            topology=topology,
            comm=comm,
            layers=layers,
            spec=spec,
            dataset=dataset,
            sampler=sampler,
            global_batch_size=int(job.global_batch_size),
            bucket_bytes=BUCKET_BYTES,
            overlap_grad_reduce=overlap,
        )
        run_schedule(ctx, 0)
        launched_in_backward = ctx.reducer.launched
        sync_gradients(ctx)
        grads = {
            (i, name): p.grad.clone() for i, layer in layers.items() for name, p in layer.module.named_parameters()
        }
        # backward accumulated into the buckets themselves: every concatenated bucket's
        # parameters' gradients are still views of its one flat tensor after the reduction
        views = all(
            p.grad.untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr()
            for b in ctx.reducer.order
            if not b.tied
            for p in b.params
        )
        ctx.close()
        assert not any(p._post_accumulate_grad_hooks for layer in layers.values() for p in layer.params)
        assert all(p.grad is None for layer in layers.values() for p in layer.params)  # buckets let go
        return {
            "launched": launched_in_backward,
            "buckets": [(b.group, [tuple(p.shape) for p in b.params]) for b in ctx.reducer.order],
            "grads": grads,
            "views": views,
        }

    return run_ranks(plan, rank, store=store, generation=generation, tied_layers=spec.tied_layers)


def test_overlapped_buckets_give_the_same_gradients_as_after_backward(shared_store):
    overlapped = reduce_once(True, 0, shared_store)
    after = reduce_once(False, 1, shared_store)
    for ranks in (overlapped, after):
        assert ranks[0]["buckets"] == ranks[1]["buckets"] and len(ranks[0]["buckets"]) >= 4
    buckets = len(overlapped[0]["buckets"])
    assert [r["launched"] for r in overlapped] == [buckets, buckets]  # all in flight before backward returned
    assert [r["launched"] for r in after] == [0, 0]
    assert all(r["views"] for r in overlapped + after)
    for rank in range(2):
        for key, grad in overlapped[rank]["grads"].items():
            assert torch.equal(grad, after[rank]["grads"][key]), key
            assert torch.equal(grad, overlapped[1 - rank]["grads"][key]), key
    # the tied copies (embedding, head) both hold the summed gradient
    spec = model_spec(tiny_config().model, 0)
    (first, last), (a, b) = spec.tied[0].layers, spec.tied[0].names
    assert torch.equal(overlapped[0]["grads"][(first, a)], overlapped[0]["grads"][(last, b)])


def test_a_gradient_put_outside_its_bucket_is_copied_back_into_it():
    from oobleck.runtime.executor import _Bucket

    params = [torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(4))]
    bucket = _Bucket("g", params, params, flat=torch.full((10,), 7.0))
    bucket.views = [bucket.flat[:6].view(2, 3), bucket.flat[6:]]
    bucket.attach()
    assert torch.equal(bucket.flat, torch.zeros(10)) and params[0].grad is bucket.views[0]
    params[1].grad = torch.arange(4.0)  # not accumulated in place (e.g. a sparse or double backward)
    params[0].grad = None
    bucket.reclaim()
    assert params[1].grad is bucket.views[1] and params[0].grad is bucket.views[0]
    assert torch.equal(bucket.flat, torch.cat([torch.zeros(6), torch.arange(4.0)]))
