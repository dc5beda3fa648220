"""Search for inputs on which a rescale policy gives a non-finite output, and shrink them.

    from fa_lab.studies import adversary
    res = adversary.search("lazy_unfixed", budget_s=30, seed=0)
    res.found, res.shrunk.size, res.repro        # the smallest failing input and one line
    adversary.save_regression(res, "tests/studies/regressions/lazy_unfixed.npz")
    results.save("attack_mine", adversary.record("lazy_unfixed", [(res, wall_s)], params={}))
    adversary.load_record("attack_lazy_unfixed", reference=True)   # the lab's reference run

    fa-lab attack POLICY [--budget 60] [--space scores|values|zoo] [--mods bias,alibi,sink]
                         [--classes nonfinite,empty,silent,saturation,nan_factor]
                         [--seed 0] [--json] [--baseline eager] [--random-starts]
                         [--optimizer cma|es] [--regression FILE.npz]

**What counts as a failure**: the model (``backend="emulator"``, the bf16/f16
DUALWAVE_SWP kernel) returns a row with a non-finite element where an fp64 reference
(``reference.attention(dtype=float64)``, given the same score modifiers) is finite, or,
with ``tolerance``, a finite row whose max error exceeds ``tolerance * max|ref row|``.

**Rows that are not judged.** A row is judged only where the attention it asks for is
defined: the reference's output row *and* its LSE are finite. A row with no finite logit
(every key masked by a -inf bias or by the causal diagonal, and no sink) has softmax
0 / 0. The reference writes 0 there by convention with LSE = -inf, and no kernel owes it
anything: DUALWAVE_SWP returns 0 in causal builds (the causal floor keeps its base finite)
and NaN in non-causal ones. Such rows are reported (``Verdict.undefined_rows``), never
counted as the policy's failure. With a sink the same row *is* defined (all weight on the
sink, output 0) and is judged.

**The search space** (``SPACES``) is named and bounded. An input is a ``Candidate``:

* family ``"onehot"``: rows built from per-row score sequences, as PR #1033's one-hot fp8
  test builds them (and ``experiments.drag_case``): row ``r`` has ``Q[r, d_r] = 8`` on its
  own dimension, so ``K[:, d_r]`` *is* its score sequence. A *trigger* row's per-tile peak
  rises by ``rise`` per tile; ``1 + n_victims`` *victim* rows start at ``start`` and fall
  by ``fall`` per tile (plus ``wobble`` alternating and ``noise``); the peak sits at column
  ``peak_col`` of each tile and the rest of the tile ``background`` below it. The rows'
  places in the wave (``trigger_row``, ``victim_row``), the KV length (``n_tiles``,
  ``trim``), Sq (``n_rows``), ``causal``, D and the dtype are searched too.
* family ``"random"``: the seed's recipe at small sizes: q, v ~ N(0, 1),
  k = N(0, 1) * ``k_scale``.
* V is all ones, random signs or N(0, 1), times ``2**v_log2``: ``"scores"`` keeps
  ``v_log2 <= 2`` (the values users have); ``"values"`` lets it reach 2^126, which finds the
  limit of *every* online softmax's unnormalised fp32 accumulator.
* **Score modifiers**, only when asked (``mods=``, ``--mods``; ``MODS``), as
  ``flash_attn_func`` takes them (natural-log units):

  - ``bias`` [Sq, Skv] in q's dtype: an additive mask (``mask``) of the kinds users pass,
    key padding on the right (``pad_right``: the last ``mask_len`` keys), left padding
    (``pad_left``: the first ``mask_len`` keys), a block-diagonal document mask
    (``block_diag``: documents of ``mask_len`` keys, the rows split among them in
    proportion) or a block-sparse mask (``block_sparse``: blocks of 16 rows x ``mask_len``
    keys, each visible with probability ``mask_density``), with masked entries ``-inf`` or
    ``torch.finfo(dtype).min`` (``mask_value``), plus N(0, ``bias_scale``^2) on every entry;
  - ``alibi_slopes`` [1]: ``alibi_slope`` (0: not passed);
  - ``sink`` [1]: one extra logit ``sink_logit`` (``sink`` False: not passed).

  Without a modifier its fields are pinned "off", so a space without mods is exactly the
  space it was before modifiers existed. A modifier the model of the kernel cannot run
  under the policy is refused before any work (``check_mods``).

**The optimiser** starts from a few structured starting points (a drag case, staircases,
the seed's recipe; ``structured=False`` skips them) and four random draws, then climbs
from the best of them (``optimizer=``, ``--optimizer``; ``OPTIMIZERS``):

* ``"cma"`` (the default): mixed-integer CMA-ES (the ``cma`` package) with restarts. Every
  field the space searches is one coordinate in its own units, bounded by its range and
  scaled by its width: numbers as they are, ints rounded, a choice (family, dtype, D,
  causal, V's kind, the mask's kind) as the index of its value; ints and choices are
  ``cma``'s integer variables, so their steps never shrink below one value. The seed is
  not a coordinate: each candidate draws its own, so a run climbs towards the settings
  where failing draws are likely rather than polishing one lucky draw. A run ends on
  CMA-ES's own termination or after 8 generations without a gain of 0.5; the restarts
  alternate between a fresh random point and the best input so far with the population
  doubled (IPOP).
* ``"es"``: a (1 + λ) evolution strategy with restarts that mutates a few fields at a time
  (choices included) with a step that grows on success and shrinks on failure.

Both maximise the same fitness: ``fa_lab.studies.onset``'s tile-level estimate of how close the
worst row comes to 2^128 (``128 - margin``: continuous, cheap), so the search climbs
towards overflow before any row overflows; every candidate is then judged by the model
itself. Both are deterministic for a seed (given ``max_evals``: the wall-clock budget
decides how far a run gets), and neither touches numpy's global random state.

**The failure zoo's presets** (``fa_lab.zoo``: policies that set ``fa_lab.semantics``
fields) run on the online-softmax family's model (``kernel_for``), in the ``"zoo"`` space
by default: the ``"scores"`` family (each row's scores ``spread`` x N(0, 1) log2 units), an
outlier key (``jump`` at ``jump_col``), every raw logit ``shift``-ed far below zero, a KV
cache whose slots past ``seqused`` x Skv hold NaN (``cache``; down to seqlen_kv = 0), and
masks that hide rows (``pad_rows``), first tiles (``pad_left``) or blocks. A candidate
fails on the *classes* asked for (``CLASSES``: ``nonfinite``, ``empty`` (a row that sees
nothing gives anything but 0), ``silent`` (a finite row off the fp64 reference by more than
``silent_tol`` x max|V|), ``saturation`` and ``nan_factor``); by default a preset's entry's
own (``Entry.failure``). ``region=`` keeps every judged run inside a region
(``fa_lab.studies.onset.bound``), and a search that finds nothing reports "nothing in N runs
found a failure".

**Shrinking** a failing input: greedy passes that try fewer tiles, fewer rows, no trim,
non-causal, D = 64, bf16, no noise, no wobble, no extra victims, a flat tile, V = ones, no
modifier (each one off), and the smallest magnitudes (bisection: also the padding length)
and simplest row placement, keeping each change only if the model still fails. The result
is what ``save_regression`` checks in, modifiers included.

**The paged decode** has a space of its own (``adversary.decode``: page tables, partition
boundaries, fully masked tiles, empty contexts, stale or NaN cache tails, per-token scale
outliers) and its own search (``adversary.decode_search``), run against a decode version:
``fa-lab attack flydsl-985c653a^`` (docs/semantics.md §13.4a). **The paged fp8 prefill**
(FlyDSL #1066) has one too (``adversary.paged_fp8``: odd page counts and their partner
pages, padding pairs, empty contexts, rows that see no key, stale or NaN slots without a
key, outlier keys and values, q descales towards the causal floor's limit), with its own
``search`` against a paged version (``fa_lab.upstream.FP8_PAGED_VERSIONS``; ``fa-lab attack
flydsl-6aeb4321``). **The MLA decode** has one too (``adversary.mla``: contexts and KV
splits, empty sequences, Gaussian or one-peak scores, V of ones, signs or N(0, 1)), judged
for the mass its unscaled e4m3 P cast loses (``silent``: a row off fp64 by more than 2^-3
max|V|, which a lift of P by 2^8 cannot reach), against a ``p_headroom``: ``fa-lab attack
mla_decode [--p-headroom 8]``. The decode and MLA searches share one loop
(``adversary.climb``).

**Records**: ``record`` makes the one result file every attack run writes (``fa-lab
attack`` and the campaigns in benchmarks/: ``RECORD_KEYS``, one summary row and one
``Attack.to_dict()`` per run); ``load_record`` reads one back, checked, from the results
folder or (``reference=True``) the lab's reference data.
"""

from .space import (FIELDS, MODS, MOD_ALIASES, parse_mods, Space, SPACES, Candidate, ONEHOT_ONLY,
                    RANDOM_ONLY, canonical, build, SPARSE_BLOCK_ROWS, mask_of, build_mods, KERNEL,
                    check_mods, ZOO_FIELDS, kernel_for, check_space, visible, first_tile_visible)
from .judge import (Verdict, judged_rows, judge, CLASSES, SILENT_TOL, default_classes,
                    check_classes, zoo_judge, run_online, reference_of,
                    softcap_reference)
from .optimize import (random_candidate, mutate, STARTS, MOD_STARTS, ZOO_STARTS, Attack,
                       OPTIMIZERS, search, summary)
from .shrink import shrink_candidate, trace_rows
from .regression import tensor_digest, save_regression, load_regression, run_regression
from .record import RECORD_KEYS, RUN_KEYS, summary_row, record, check_record, load_record

__all__ = ["FIELDS", "MODS", "MOD_ALIASES", "parse_mods", "Space", "SPACES", "Candidate", "ONEHOT_ONLY",
           "RANDOM_ONLY", "canonical", "build", "SPARSE_BLOCK_ROWS", "mask_of", "build_mods",
           "KERNEL", "check_mods", "ZOO_FIELDS", "kernel_for", "check_space", "visible",
           "first_tile_visible", "Verdict", "judged_rows", "judge", "CLASSES", "SILENT_TOL",
           "default_classes", "check_classes", "zoo_judge", "run_online", "reference_of",
           "softcap_reference",
           "random_candidate", "mutate", "STARTS", "MOD_STARTS", "ZOO_STARTS", "Attack",
           "OPTIMIZERS", "search", "summary", "shrink_candidate", "trace_rows", "tensor_digest",
           "save_regression", "load_regression", "run_regression", "RECORD_KEYS", "RUN_KEYS",
           "summary_row", "record", "check_record", "load_record"]
