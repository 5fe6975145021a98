"""What each process of ``tests/test_fsdp2_bf16.py``'s groups runs: FSDP2 with a bfloat16
``MixedPrecisionPolicy``, tracked, and on each process the reference that reproduces its
rounding (:func:`low_precision_reference`; the test module's docstring says why it is the
same computation). :func:`worker` runs every job in one launch per world size.
"""

import functools
import warnings

import cockpit_gradnoise as cgn  # first, also in spawned processes: makes `import cockpit` work

import torch
import torch.nn.functional as F
from cockpit.utils.schedules import linear

from tests.process_groups import run_jobs
from tests.test_fsdp2 import Net, make_batch, table, trainable

LR = 0.1
STEPS = 2
SIZES = {2: (3, 5), 3: (2, 4, 3)}  # local batches: 1/N_r is not a power of two
QUANTILES = (0.0, 0.25, 0.5, 1.0)
LAYERS = ("fc1", "fc2")  # the trained Linears (frozen: no gradient; unused: no rows)
JOBS = {  # job: (fully_shard every Linear, reshard_after_forward, reduction, reduce_dtype, optimizer)
    "mean": (True, True, "mean", torch.float32, "SGD"),
    "sum": (False, False, "sum", torch.float32, "SGD"),
    "reduce_bf16": (True, True, "mean", torch.bfloat16, "SGD"),
    "adam": (True, True, "mean", torch.float32, "Adam"),  # PreconditionedNoiseScale alone
    "accumulation": (True, False, "mean", torch.float32, "SGD"),  # two micro-batches per step
}
MICRO_BATCHES = {"accumulation": 2}
NORMS_JOBS = {"norms": torch.float32, "norms_reduce_bf16": torch.bfloat16}  # job: reduce_dtype
FRONT_DOOR = "mean"  # through cgn.track after fully_shard; the others a Cockpit over the sharded parameters
ADAM = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}


def per_example(names):
    return [cgn.GradientNoiseScale(linear(1), param_names=names),
            cgn.PerExampleGradNorm(linear(1), quantiles=QUANTILES, param_names=names),
            cgn.GradientVarianceQuantiles(linear(1), quantiles=QUANTILES, param_names=names)]


def from_grad(names):
    return [cgn.ParamGradRatio(linear(1), param_names=names), cgn.UpdateSize(linear(1), param_names=names)]


def local_batch(world, rank, step, micro_batch=0):
    sizes = SIZES[world]
    x, y = make_batch(sum(sizes), seed=100 + step + 10 * micro_batch)
    start = sum(sizes[:rank])
    return x[start : start + sizes[rank]].float(), y[start : start + sizes[rank]]


def scaled(losses, reduction):
    return losses.mean() if reduction == "mean" else losses.sum()


def capture(model):
    """``{layer: [input, output gradient]}`` of the trained Linears, refreshed by each pass."""
    seen = {layer: [None, None] for layer in LAYERS}

    def hook(layer):
        def keep(module, args, output):
            seen[layer][0] = args[0].detach()
            output.register_hook(lambda g: seen[layer].__setitem__(1, g.detach()))
        return keep

    for layer in LAYERS:
        getattr(model, layer).register_forward_hook(hook(layer))
    return seen


def low_precision_reference(full, x, y, reduction, micro_batches=1, dtype=torch.bfloat16):
    """This process's bfloat16 computation on a plain copy: per-example gradients and the factors.

    ``full``: the float32 parameters, gathered. Returns the per-example gradients (float64,
    ``[N_r, *shape]``, in the units of this process's loss): by autograd, rounded to bfloat16
    as the pass rounds them, and the batch's factors multiplied out in float64 (a Linear's
    ``g_i a_i^T``); ``A_i``, the magnitudes of the products (``|g_i| |a_i|^T`` for a weight,
    ``|g_i|`` for a bias), ``K`` (the numbers of example ``i`` a rule reads), the batch's factors,
    the copy's batch gradient, and whether each example's output gradient rows in its own
    backward pass equal its rows in the batch's.
    """
    copy = Net()
    copy.load_state_dict(full)
    copy = copy.to(dtype)  # FSDP2's cast of each shard, elementwise: the same numbers
    seen = capture(copy)
    losses = F.cross_entropy(copy(x.to(dtype)).float(), y, reduction="none")
    n = len(y)
    names = [f"{layer}.{leaf}" for layer in LAYERS for leaf in ("weight", "bias")]
    params = dict(copy.named_parameters())
    rows, rows_agree = {name: [] for name in names}, True
    per_example_g = []
    for i in range(n):
        own = (losses[i] / n if reduction == "mean" else losses[i]) / micro_batches
        grads = torch.autograd.grad(own, [params[name] for name in names], retain_graph=True)
        for name, g in zip(names, grads):
            rows[name].append(g.double())
        per_example_g.append({layer: seen[layer][1].clone() for layer in LAYERS})
    (scaled(losses, reduction) / micro_batches).backward()
    factors = {layer: (a.clone(), g.clone()) for layer, (a, g) in seen.items()}
    for i, gs in enumerate(per_example_g):
        for layer, g in gs.items():
            others = torch.cat([g[:i], g[i + 1 :]])
            rows_agree &= torch.equal(g[i], factors[layer][1][i]) and not others.any()
    terms, products, elements = {}, {}, {}
    for layer, (a, g) in factors.items():
        a, g = a.double(), g.double()
        products[f"{layer}.weight"], products[f"{layer}.bias"] = torch.einsum("no,ni->noi", g, a), g
        elements[f"{layer}.weight"], elements[f"{layer}.bias"] = torch.einsum("no,ni->noi", g.abs(), a.abs()), g.abs()
        terms[f"{layer}.weight"] = terms[f"{layer}.bias"] = g.shape[1] + a.shape[1]
    return {"autograd": {name: torch.stack(r) for name, r in rows.items()}, "products": products,
            "elements": elements, "terms": terms, "factors": factors, "rows_agree": rows_agree,
            "local_grad": {name: params[name].grad.clone() for name in names}}


def bf16_job(job, world, rank, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    per_linear, reshard, reduction, reduce_dtype, optimizer_name = JOBS[job]
    front_door = job == FRONT_DOOR
    torch.manual_seed(0)
    model = Net() if front_door else cgn.prepare_model(Net())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    if per_linear:
        for module in (model.fc1, model.fc2, model.frozen, model.unused):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    if front_door:  # the default preset: the five quantities
        model, cockpit = cgn.track(model, every=1, quantiles=QUANTILES,
                                   options={"PerExampleGradNorm": {"quantiles": QUANTILES}})
    seen = capture(model)
    named = trainable(model)
    params = [p for _, p in named]
    if optimizer_name == "Adam":
        quantities = [cgn.PreconditionedNoiseScale(linear(1), param_names=dict(named))]
        optimizer = torch.optim.Adam(params, **ADAM)
    else:
        quantities = per_example(dict(named)) + from_grad(dict(named))
        optimizer = torch.optim.SGD(params, lr=LR)
    if not front_door:
        cockpit = cgn.Cockpit(params, quantities=quantities)
    micro_batches, steps = MICRO_BATCHES.get(job, 1), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            full = {name: p.full_tensor() for name, p in model.named_parameters()}
            # Adam's second moment before this step's update (none at the first), gathered.
            moments = {name: optimizer.state[p]["exp_avg_sq"].full_tensor() for name, p in named
                       if "exp_avg_sq" in optimizer.state.get(p, {})}
            optimizer.zero_grad()
            parts = []
            for k in range(micro_batches):
                x, y = local_batch(world, rank, step, k)
                part = low_precision_reference(full, x, y, reduction, micro_batches)
                # The float32 model's (FSDP2 without the policy): not what the bfloat16 pass gives.
                float32 = low_precision_reference(full, x, y, reduction, micro_batches, torch.float32)
                part["float32"] = float32["autograd"]
                losses = F.cross_entropy(model(x).float(), y, reduction="none")
                loss = scaled(losses, reduction) / micro_batches
                if front_door:
                    with cockpit(step, losses, optimizer=optimizer) as loss:
                        loss.backward()
                else:
                    info = {"batch_size": len(y), "loss": loss, "individual_losses": losses, "optimizer": optimizer}
                    if micro_batches > 1:
                        info.update(micro_batch=k, micro_batches=micro_batches)
                    with cockpit(step, info=info):
                        loss.backward()
                part["factors_agree"] = all(torch.equal(a, seen[layer][0]) and torch.equal(g, seen[layer][1])
                                            for layer, (a, g) in part.pop("factors").items())
                part["scale"] = (1.0 / len(y) if reduction == "mean" else 1.0) / micro_batches
                parts.append(part)
            grads = {name: p.grad.full_tensor() for name, p in named if p.grad is not None}
            optimizer.step()
            steps.append({"params": {name: full[name] for name, _ in named}, "grads": grads, "moments": moments,
                          "parts": parts})
    return {"table": table(cockpit), "steps": steps, "warnings": [str(w.message) for w in caught]}


def norms_job(world, rank, mesh, *, reduce_dtype):
    """The front door: ``cgn.track(model, quantities="norms")`` after ``fully_shard`` with the
    policy (every Linear and the root, a mean loss, FSDP2's gradient reduced in
    ``reduce_dtype``); each step's gathered FSDP2 gradient,
    the copy's batch gradient and FSDP2's unsharded bfloat16 gradient of this process (the
    package's own hook on it, :func:`cockpit_gradnoise.fsdp2.hook_unsharded`)."""
    from cockpit_gradnoise import fsdp2

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Net()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    for module in (model.fc1, model.fc2, model.frozen, model.unused, model):
        fully_shard(module, mesh=mesh, mp_policy=policy)
    model, tracker = cgn.track(model, every=1, quantities="norms")
    named = trainable(model)
    optimizer = torch.optim.SGD([p for _, p in named], lr=LR)
    steps, hooked, unsharded = [], {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unused layer's
        for step in range(STEPS):
            x, y = local_batch(world, rank, step)
            full = {name: p.full_tensor() for name, p in model.named_parameters()}
            reference = low_precision_reference(full, x, y, "mean")
            optimizer.zero_grad()
            losses = F.cross_entropy(model(x).float(), y, reduction="none")
            fsdp2.hook_unsharded([p for _, p in named], lambda k, g: unsharded.__setitem__(named[k][0], g.clone()),
                                 hooked)
            with tracker(step, losses, optimizer=optimizer) as loss:
                loss.backward()
            grads = {name: p.grad.full_tensor() for name, p in named if p.grad is not None}
            optimizer.step()
            steps.append({"grads": grads, "local_grad": reference["local_grad"], "unsharded": dict(unsharded)})
    return {"table": table(tracker), "steps": steps}


def float16_job(world, rank, mesh):
    """A float16 policy through the front door: the error at the first tracked step (FSDP2
    sets the parameters' dtype at its first forward pass, after ``cgn.track``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = fully_shard(Net(), mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    model, tracker = cgn.track(model, every=1)
    x, y = local_batch(world, rank, 0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with tracker(0, F.cross_entropy(model(x).float(), y, reduction="none")) as loss:
                loss.backward()
    except TypeError as error:
        return str(error)
    return None


def worker(rank, world, port, out):
    jobs = {job: functools.partial(bf16_job, job, world, rank) for job in JOBS}
    for job, dtype in NORMS_JOBS.items():
        jobs[job] = functools.partial(norms_job, world, rank, reduce_dtype=dtype)
    jobs["float16"] = functools.partial(float16_job, world, rank)
    run_jobs(rank, world, port, out, jobs)

