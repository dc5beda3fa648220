"""One table from a checked call to the code that runs it.

``TABLE`` maps (kernel family, backend) to an ``Entry``: the entry point and what it can
do (dtypes, head dims, features, the policy fields it runs). ``plan`` is the one place
that decides: upstream's routing (``fa_lab.routing``) picks the family, ``backend="auto"``
picks an execution, and every capability is checked against the table before any work;
``run`` executes a planned call. fa_lab reaches the Triton kernels through here only.

Backends: ``emulator`` the exact PyTorch model (any device); ``triton`` the faithful
Triton ports on GPU tensors; ``interpret`` the same ports on CPU tensors through Triton's
interpreter; ``fast`` the fast Triton kernels (their own tiling, the same policy
semantics; compiled on GPU tensors, interpreted on CPU tensors); ``flydsl`` upstream's
own kernel on an MI355X (``fa_lab.flydsl``); ``auto`` the faithful ports on GPU tensors
where they cover the call, else the model.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import warnings
from dataclasses import dataclass

import torch

from fa_lab import capabilities, kernels, routing, varlen
from fa_lab.capabilities import Caps
from fa_lab.checks import caller_stacklevel
from fa_lab.kernels import FAMILIES
from fa_lab import upstream as upstream_versions
from fa_lab.kernels._common.geometry import BLOCK_M, BLOCK_N, tiles_for_block
from fa_lab.policies import Policy, Request, as_policy, get

BACKENDS = ("auto", "emulator", "triton", "interpret", "fast", "flydsl")


#: The implementation each backend runs (``fa_lab.capabilities``).
IMPLEMENTATION = {"emulator": "model", "triton": "faithful", "interpret": "faithful",
                  "fast": "fast"}


@dataclass(frozen=True)
class Entry:
    """What one (family, backend) runs: the family's implementation (its module is
    imported on first use: Triton is optional and slow to import), the tensor device type
    it needs (None: any) and its capabilities (``Caps``)."""

    family: str
    backend: str
    impl: str
    caps: Caps
    device: str | None = None

    @property
    def triton(self) -> bool:
        return self.backend in ("triton", "interpret", "fast")

    def load(self):
        """The implementation's module (its ``forward``)."""
        return kernels.module(self.family, self.impl)

    @property
    def has_varlen(self) -> bool:
        return FAMILIES[self.family].implementations[self.impl].varlen is not None

    def varlen_load(self):
        """The module with the implementation's one-launch ``forward_varlen``."""
        name = FAMILIES[self.family].implementations[self.impl].varlen
        return importlib.import_module(f"{kernels.__name__}.{self.family}.{name}")


#: The tensor device type each backend needs: compiled on GPU tensors, the interpreter
#: takes CPU tensors, "fast" and the model go by the tensors' device.
DEVICES = {"emulator": None, "triton": "cuda", "interpret": "cpu", "fast": None}


def _entries():
    table = {}
    for backend, impl in IMPLEMENTATION.items():
        for name, fam in FAMILIES.items():
            if impl in fam.implementations:
                table[(name, backend)] = Entry(name, backend, impl, fam.caps(impl), DEVICES[backend])
    return table


#: (family, backend) -> Entry: the one table, built from the registered families.
TABLE: dict[tuple[str, str], Entry] = _entries()
#: The families ``flash_attn_func`` routes to (``kernel=`` takes these).
ROUTED = tuple(name for name, fam in FAMILIES.items() if fam.routed)
#: The routed families that model upstream FlyDSL's kernels (upstream's routing picks among
#: them); the others are fa_lab's own and run where a policy or ``kernel=`` asks for them.
_FLYDSL = tuple(name for name in ROUTED if FAMILIES[name].upstream)


def entry(family: str, backend: str) -> Entry:
    if (family, backend) not in TABLE:
        raise ValueError(f"backend={backend!r} has no {family} kernel; it has "
                         f"{sorted(f for f, b in TABLE if b == backend)}")
    return TABLE[(family, backend)]


def policy_refusal(e: Entry, policy: Policy) -> str | None:
    """Why ``e`` cannot run ``policy`` (naming the field and the backend), or None."""
    return capabilities.policy_refusal(e.caps, policy,
                                       f"the {e.family} kernel on backend={e.backend!r}")


def supports(e: Entry, policy: Policy) -> bool:
    return policy_refusal(e, policy) is None


@dataclass(frozen=True)
class Call:
    """A checked call: everything a backend receives, checked once (``api.check_call``).

    ``request``: the rescale arguments as given (``policies.Request``); ``policy``: the
    policy resolved from them for the routed family (set by ``plan``); ``mods``: the bias /
    alibi_slopes / sink / num_kv_splits that were given; ``packing``: varlen boundaries
    (q, k, v then packed [total, H, D]); ``kernel_asked``: the kernel= given, if any."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    request: Request
    fp8: bool
    descales: tuple[float, float, float] | None
    fp8_saturate: bool
    backend: str
    mods: dict
    head_dim: int
    batch: int
    seqlen_q: int
    seqlen_kv: int
    packing: varlen.Packing | None = None
    kernel_asked: str | None = None
    upstream: str = "fixed"
    return_lse: bool = False
    policy: Policy | None = None

    @property
    def policy_asked(self) -> bool:
        """The caller asked for a rescale (``Request.explicit``)."""
        return self.request.explicit(fp8=self.fp8,
                                     reads_flag=upstream_versions.get(self.upstream).fp8_reads_flag)

    @property
    def features(self) -> tuple[str, ...]:
        return (*self.mods, *(("varlen",) if self.packing is not None else ()))

    @property
    def dtype(self) -> str:
        return "fp8" if self.fp8 else {torch.bfloat16: "bf16", torch.float16: "f16"}[self.q.dtype]


@dataclass(frozen=True)
class Plan:
    """A call with its family, backend and entry settled."""

    call: Call
    family: str
    backend: str
    entry: Entry | None  # None for backend="flydsl"


def semantic_family(policy: Policy) -> str | None:
    """The routed family whose model runs every ``fa_lab.semantics`` field ``policy`` sets
    away from its default (the online-softmax family), or None for a policy that sets none:
    no FlyDSL kernel has such semantics, so such a policy runs there whatever the shape."""
    if policy is None or not policy.semantic_fields:
        return None
    able = [f for f in ROUTED if capabilities.semantics_refusal(
        TABLE[(f, "emulator")].caps, policy, f) is None]
    if not able:
        raise ValueError(f"no kernel family runs policy {policy.name!r}: it sets semantics "
                         f"field(s) {', '.join(policy.semantic_fields)}")
    return able[0]


def choose_kernel(*, batch: int, seqlen_q: int, fp8: bool, rescale=None, kernel: str | None = None,
                  has_bias: bool = False, has_alibi: bool = False, has_sink: bool = False,
                  head_dim: int = 128, arch: str = routing.DUALWAVE_ARCH) -> str:
    """The family that runs a dense call ("swp_bf16", "swp_fp8", "generic" or "online"):
    upstream's routing (``fa_lab.routing``), except that an explicit ``rescale`` (a name or
    Policy) the routed kernel lacks selects DUALWAVE_SWP, a policy with semantics of its
    own (``Policy.semantic_fields``) selects the family that runs them
    (``semantic_family``: the online-softmax model), and an explicit ``kernel`` wins but
    must be able to do what was asked (and the features asked for)."""
    routing.check_positive_int("batch", batch)
    routing.check_positive_int("seqlen_q", seqlen_q)
    routing.check_bool("fp8", fp8)
    routing.check_positive_int("head_dim", head_dim)
    routing.check_arch(arch)
    features = routing.features(has_bias, has_alibi, has_sink)
    if kernel is not None and (not isinstance(kernel, str) or kernel not in ROUTED):
        raise ValueError(f"kernel={kernel!r} is not a kernel fa_lab routes; choose one of "
                         f"{ROUTED} (the SWA kernel is called through swa_attn_func)")
    policy = None if rescale is None else as_policy(rescale)

    def implements(family):
        return policy is None or supports(TABLE[(family, "emulator")], policy)

    own = semantic_family(policy)
    if kernel is None and own is not None:
        return own
    if kernel is not None and kernel not in _FLYDSL:
        # a family of fa_lab's own (not one of upstream's kernels): no upstream routing
        if not implements(kernel):
            raise ValueError(f"kernel={kernel!r} has no rescale={policy.name!r}: "
                             f"{policy_refusal(TABLE[(kernel, 'emulator')], policy)}")
        return kernel
    if fp8:
        if kernel is not None and kernel != "swp_fp8":
            raise ValueError(f"kernel={kernel!r} does not take float8_e4m3fn inputs; "
                             "fp8 runs on kernel='swp_fp8'")
        routing.check_fp8(features, head_dim, arch)
        return "swp_fp8"
    if kernel == "swp_fp8":
        raise ValueError("kernel='swp_fp8' takes float8_e4m3fn inputs only; bf16/f16 run on "
                         "'swp_bf16' or 'generic'")
    if kernel is not None:
        if not implements(kernel):
            raise ValueError(f"kernel={kernel!r} has no rescale={policy.name!r}: "
                             f"{policy_refusal(TABLE[(kernel, 'emulator')], policy)}; drop one "
                             "of the two, or use kernel="
                             f"{semantic_family(policy) or 'swp_bf16'!r}")
        if kernel == "generic" and features:
            raise ValueError(f"kernel='generic' folds in no {features[0]}; use kernel='swp_bf16'")
        if kernel == "swp_bf16" and not routing.can_dualwave(head_dim, arch):
            raise ValueError(f"kernel='swp_bf16' (DUALWAVE_SWP) needs D 64 or 128 on gfx950; got "
                             f"head_dim={head_dim}, arch={arch!r}")
        return kernel
    routed = "swp_bf16" if routing.dense_routes_to_dualwave(
        batch, seqlen_q, has_bias, has_alibi, has_sink, head_dim=head_dim, arch=arch) else "generic"
    if not implements(routed):
        # The eager-only generic kernel cannot honour a lazy policy: DUALWAVE_SWP can
        # (``plan`` warns that this departs from upstream's routing).
        if not routing.can_dualwave(head_dim, arch):
            raise ValueError(f"rescale={policy.name!r} needs the DUALWAVE_SWP kernel (D 64 or 128 "
                             f"on gfx950); got head_dim={head_dim}, arch={arch!r}, where only the "
                             "eager generic kernel runs")
        return "swp_bf16"
    return routed


def auto_backend(family: str, device_type: str, features, policy: Policy, triton: bool) -> str:
    """What ``backend="auto"`` runs: the faithful Triton port for GPU tensors when Triton
    imports (``triton``) and the port covers the features and the policy; else the model."""
    e = TABLE.get((family, "triton"))
    if device_type == "cuda" and triton and e is not None and supports(e, policy) \
            and set(features) <= e.caps.features:
        return "triton"
    return "emulator"


def _resolve_backend(call: Call, family: str) -> str:
    if call.backend != "auto":
        return call.backend
    from fa_lab.kernels import available
    return auto_backend(family, call.q.device.type, call.features, call.policy,
                        call.q.device.type == "cuda" and available())


class RoutingWarning(UserWarning):
    """A call runs on another kernel than upstream's would, or its policy is never consulted
    there: what ran differs from what the call seems to ask for."""


#: The (reason, family, policy) of every warning ``plan`` gave: each is given once.
_WARNED: set = set()
_QUIET = contextvars.ContextVar("fa_lab_routing_quiet", default=False)


@contextlib.contextmanager
def routing_quiet():
    """Calls made inside give no routing warning and leave each one unspent: for a tool's
    own calls (the attack's candidates and their shrinking), whose shapes the user did not
    choose. Usable as a decorator."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


def _warn_once(key, message: str) -> None:
    """Warn at the user's line: the first frame outside fa_lab (``checks.caller_stacklevel``)."""
    if key not in _WARNED and not _QUIET.get():
        _WARNED.add(key)
        warnings.warn(message, RoutingWarning, stacklevel=caller_stacklevel())


def route(call: Call, notes: list) -> str:
    """The family that runs ``call``: upstream's routing (``choose_kernel``), then fa_lab's
    own rules for what upstream's kernels do not model (split-K and varlen are DUALWAVE_SWP
    builds; the fast kernels implement DUALWAVE_SWP's semantics at every length). A reroute
    the user should know of is appended to ``notes`` as (key, message)."""
    version = upstream_versions.get(call.upstream)
    wanted = None
    if call.policy_asked:
        wanted = call.request.wanted(version.default_policy(fp8=call.fp8,
                                                            lazy_flag=call.request.lazy_flag is not False))
    shape = dict(batch=call.batch, seqlen_q=call.seqlen_q, fp8=call.fp8,
                 has_bias="bias" in call.mods, has_alibi="alibi_slopes" in call.mods,
                 has_sink="sink" in call.mods, head_dim=call.head_dim)
    family = choose_kernel(rescale=wanted, kernel=call.kernel_asked, **shape)
    if family not in _FLYDSL:
        return family  # a family of fa_lab's own runs the call as asked: no upstream rules
    upstreams = choose_kernel(**shape) if call.kernel_asked is None and wanted is not None else family
    if (family != upstreams and call.packing is None and "num_kv_splits" not in call.mods
            and call.backend != "fast"):  # (the fast kernels are DUALWAVE_SWP at every length)
        has = "a Python rule" if wanted.rule is not None else f"vote={wanted.vote!r}"
        notes.append((("rerouted", upstreams, wanted.vote, wanted.rebase, wanted.rule),
                   f"{call.request.given()}: upstream runs this call (B={call.batch}, "
                   f"Sq={call.seqlen_q}) on the {upstreams} kernel, which is eager and cannot "
                   f"apply {wanted.name!r} ({has}); fa_lab runs it on {family} instead, where "
                   f"it applies. Pass kernel={family!r} to ask for that explicitly (and no "
                   "warning), or leave the rescale out to run what upstream runs"))
    if "num_kv_splits" in call.mods and family == "generic":
        if call.kernel_asked == "generic":
            raise ValueError("kernel='generic' has no split-K; num_kv_splits > 1 runs on 'swp_bf16'")
        family = "swp_bf16"  # split-K is a DUALWAVE_SWP build, whatever the length
    if call.packing is not None and call.kernel_asked is None:
        # every sequence runs DUALWAVE_SWP (upstream's short-sequence varlen build is not modelled)
        family = "swp_bf16"
    if call.backend == "fast" and family == "generic" and call.kernel_asked is None:
        # the fast kernels implement DUALWAVE_SWP's semantics at every length (upstream's
        # short-sequence generic kernel has no fast counterpart); kernel="generic" refuses
        family = "swp_bf16"
    return family


def resolve_policy(call: Call, family: str, notes: list) -> Policy:
    """The policy ``family`` runs for ``call``: the one asked for, resolved against the call,
    or the upstream version's default where the family runs it (else eager, as upstream
    hands the lazy flag to DUALWAVE_SWP only). A policy asked for that DUALWAVE_SWP would
    never consult (no KV tile of the call reaches its lazy loop) is run, and a note in
    ``notes`` says so."""
    version = upstream_versions.get(call.upstream)
    default = version.default_policy(fp8=call.fp8, lazy_flag=call.request.lazy_flag is not False)
    if not call.policy_asked and not supports(TABLE[(family, "emulator")], default):
        default = get("eager")  # upstream hands the lazy flag to DUALWAVE_SWP only
    any_dtype = TABLE[(family, "emulator")].caps.headroom_any_dtype
    policy = call.request.resolve(fp8=call.fp8, seqlen_kv=call.seqlen_kv, default=default,
                                  headroom_any_dtype=any_dtype)
    # (a block has at least ceil(Skv / BLOCK_N) >= 5 tiles past Skv = 4 * BLOCK_N: no need to look)
    if (call.policy_asked and policy.lazy and family == "swp_bf16" and call.packing is None
            and "num_kv_splits" not in call.mods and call.seqlen_kv <= 4 * BLOCK_N):
        n = max(tiles_for_block(q0, call.seqlen_q, call.seqlen_kv, call.causal)
                for q0 in range(0, call.seqlen_q, BLOCK_M))
        if n <= 4:
            # keyed by the rule, not its numbers: a policy's variants (a dashboard's moved
            # threshold) are the same policy here
            notes.append((("never consulted", family, policy.vote, policy.rebase, policy.rule),
                          f"rescale={policy.name!r} is never consulted here: DUALWAVE_SWP "
                          f"decides lazily only on KV tiles 1 .. N-4 of each 256-row block, and "
                          f"Skv={call.seqlen_kv} gives N = {n}, so every tile rescales eagerly"))
    return policy


def plan(call: Call) -> Plan:
    """Route (``route``), resolve the policy for that family (``resolve_policy``), then
    pick the backend and check every capability; raises ValueError naming what the chosen
    backend cannot do. Does no work on the tensors' data. Routing's warnings (each once) are
    given only once every check has passed: a call that is refused is refused in silence."""
    notes: list = []
    planned = _plan(call, notes)
    for key, message in notes:
        _warn_once(key, message)
    return planned


def _plan(call: Call, notes: list) -> Plan:
    family = route(call, notes)
    call = dataclasses.replace(call, policy=resolve_policy(call, family, notes))
    backend = _resolve_backend(call, family)
    if backend == "flydsl":
        return Plan(call, family, backend, None)
    e = entry(family, backend)
    if e.device is not None and call.q.device.type != e.device:
        hint = ("use backend='interpret' (Triton's CPU interpreter) or 'emulator'"
                if e.device == "cuda" else "use backend='triton' or 'emulator'")
        need = "CPU" if e.device == "cpu" else "CUDA/ROCm"
        raise ValueError(f"backend={backend!r} needs {need} tensors, got tensors on "
                         f"{call.q.device}; {hint}")
    if call.dtype not in e.caps.dtypes:
        raise ValueError(f"backend={backend!r} has no {family} kernel for {call.dtype} inputs")
    if call.head_dim not in e.caps.head_dims:
        raise ValueError(f"backend={backend!r}: the {family} kernel takes head dims {e.caps.head_dims}, "
                         f"got D={call.head_dim}")
    missing = [f for f in call.features if f not in e.caps.features]
    if missing:
        raise ValueError(f"{', '.join(missing)} not supported by the {family} kernel on "
                         f"backend={backend!r}; {_feature_advice(family, backend, missing, call.policy)}")
    refusal = policy_refusal(e, call.policy)
    if refusal:
        raise ValueError(refusal)
    if e.triton:
        from fa_lab.kernels import unavailable
        why = unavailable()
        if why:
            raise RuntimeError(f"backend={backend!r} cannot run: {why}")
    return Plan(call, family, backend, e)


def _feature_advice(family: str, backend: str, missing: list, policy) -> str:
    """What runs ``missing`` features: another backend of ``family``, or else the kernels
    that have them (never the backend the call already uses)."""
    def has(e):
        return all(f in e.caps.features for f in missing)
    others = [b for b in BACKENDS if b != backend and (family, b) in TABLE and has(TABLE[(family, b)])]
    if others:
        return f"use backend={others[0]!r}"
    kernels = sorted({f for (f, _), e in TABLE.items() if has(e)})
    advice = f"no backend of the {family} kernel implements it"
    if kernels:
        advice += f" (the {', '.join(kernels)} kernel{'s' if len(kernels) > 1 else ''} do{'es' if len(kernels) == 1 else ''})"
    if getattr(policy, "semantic_fields", ()):
        advice += (f"; policy {policy.name!r} sets semantics fields, which only the online "
                   "kernel runs: drop the feature, or use a policy without them")
    return advice


def _kwargs(p: Plan, recorder) -> dict:
    c, e = p.call, p.entry
    kw = {"causal": c.causal}
    if "trace" in e.caps.features:
        kw["recorder"] = recorder
    elif recorder is not None:
        raise ValueError(f"backend={p.backend!r} records no trace; trace the model "
                         "(backend='emulator') or a faithful port")
    if e.triton:
        kw["interpret"] = c.q.device.type == "cpu"
    if p.family != "generic":
        kw["policy"] = c.policy
    if c.fp8:
        qd, kd, vd = c.descales
        kw.update(q_descale=qd, k_descale=kd, v_descale=vd, saturate=c.fp8_saturate)
    return kw


def _run_dense(p: Plan, recorder=None):
    c = p.call
    return p.entry.load().forward(c.q, c.k, c.v, **_kwargs(p, recorder), **c.mods)


def run(p: Plan, recorder=None):
    """Execute a planned call; returns (out, lse)."""
    c = p.call
    if p.backend == "flydsl":
        if recorder is not None:
            raise ValueError("backend='flydsl' runs upstream's kernel, which records no trace or "
                             "counts; trace and count_rescales take the other backends")
        from fa_lab import flydsl
        return flydsl.forward(c)
    if c.packing is None:
        return _run_dense(p, recorder)
    if recorder is not None:
        raise ValueError("trace and count_rescales take dense calls, not varlen")
    pk = c.packing
    if p.entry.has_varlen:
        kw = {k: v for k, v in _kwargs(p, None).items() if k != "recorder"}
        return p.entry.varlen_load().forward_varlen(
            c.q, c.k, c.v, pk.cu_q_tensor, pk.cu_kv_tensor, pk.max_seqlen_q, pk.max_seqlen_kv,
            **kw, **c.mods)
    dense_mods = {k: v for k, v in c.mods.items() if k not in ("bias", "alibi_slopes")}

    def dense(qb, kb, vb, **seq_mods):
        sub = dataclasses.replace(c, q=qb, k=kb, v=vb, mods={**dense_mods, **seq_mods}, packing=None)
        return _run_dense(dataclasses.replace(p, call=sub))

    return varlen.run(pk, c.q, c.k, c.v, dense, bias=c.mods.get("bias"),
                      alibi_slopes=c.mods.get("alibi_slopes"))
