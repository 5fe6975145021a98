"""The hand-written readings of experiments/adaptive_batch.py's page: what was found in
the runs, kept as text next to the code that writes the numbers they rest on."""

#: What was found, by hand, about the runs above (kept with the page's code so it is
#: read next to the numbers it rests on).
WHY = [
    "- History: the first version of the schedule multiplied the learning rate at each "
    "change by the rule's factor at that change's estimate (x2 on an infinite B_noise). On "
    "the digits CNN (SGD) the product compounded, 0.2 to 6.7-9.7 over five to seven "
    "doublings, and all six adaptive runs diverged. The learning rate is now the start's "
    "times the rule's factor from the start batch at the current estimate, kept without a "
    "finite estimate, and bounded (`max_lr_factor`); every digits run reaches the target.",
    "- The smoothed preconditioned noise scale was infinite throughout a GPT run, before "
    "the fix below. `b_simple_smoothed` was the ratio of moving averages (weight 0.9 on the "
    "past) of the raw `trace_cov` and `grad_sq`. Under Adam these are in units of (P g)^2, "
    "and P = 1/(sqrt(v_hat) + eps) shrinks as v fills: in a 60-step loop at batch 8 (seed "
    "0, tracking PreconditionedNoiseScale and GradientNoiseScale), step 0 gave grad_sq = "
    "-2.8e9 and trace_cov = 2.3e10, step 5 grad_sq = 2.3e4 and trace_cov = 3.0e5; the "
    "first steps' negative grad_sq dominated the average for about a hundred steps (0.9^t x "
    "2.8e9 exceeds 2.3e4 until t = 111), so `b_simple_smoothed` stayed infinite at every "
    "step while the per-step `b_simple` was finite at most (13.5 at step 4, 41.7 at step 9, "
    "31.3 at step 29); GradientNoiseScale's smoothed value was finite (3.3 to 27). "
    "`adaptive-per-example` on the GPT therefore doubled blind to 512 (mean frontier value "
    "1.78, 1.52 to 2.15, 5,785 examples). Hence the change tried first, `estimate=\"median\"` "
    "(each per-step value a ratio within one step, in one unit).",
    "- The fix: PreconditionedNoiseScale's `b_simple_smoothed` now averages each step's "
    "`trace_cov` and `grad_sq` divided by that step's own mean per-example squared norm S = "
    "grad_sq + trace_cov (each scaled value bounded, so every step weighs the same whatever P "
    "was; averages from 0, the ratio of bias-corrected ones; "
    "`cockpit_gradnoise.functional.scale_free_smoothed_noise_scale`). Dividing by the batch "
    "gradient's squared norm instead, tried first, still gave an infinite estimate at every "
    "change (seed 0): a step whose mean gradient nearly cancels has grad_sq / M unbounded "
    "below. `adaptive-per-example` (GPT) above is the rerun under the fix: every change "
    "but one rests on a finite B_noise, the batch stops at 128, and the mean frontier value "
    "moves 1.78 -> 1.24 (1.09 to 1.53; 5,785 -> 3,753 examples, 61.5 -> 71.2 steps). "
    "`adaptive-lr-kept` (GPT), which reads the same estimate, was rerun too: 13.5 (12 to "
    "15.4, batch 512) -> 5.91 (5.51 to 6.22, batch 256).",
]


#: The reading of the numbers above (written by hand after the runs of the Reproduce section).
VERDICT = [
    "- Reading of the `near-end` rerun (the rule before `resolved`): no adaptive arm's mean was "
    "below 1 on either "
    "task (the GPT's `adaptive-norms` comes to 1.00, 2 of 3 seeds below the hyperbola), and none "
    "meets \"at most the warmup's steps at no more of its examples\": the GPT's norms arm uses "
    "fewer examples than the warmup (2,319 against 2,518) but more steps (127.1 against "
    "118.2), its per-example arm fewer steps (89.7) but more examples (2,995).",
    "- On the GPT the rule did what its math says: every arm's batch stops lower (largest "
    "batch 64 -> 37, 128 -> 80, 256 -> 139), its examples fall by 12-32% and its steps rise "
    "by 8-26%: the runs slide along the frontier toward the examples-saving side. The "
    "frontier values move by less than the fixed batch's own seed spread (0.994 to 1.31), but "
    "for `adaptive-lr-kept` (5.91 -> 3.99), whose batch lay furthest above B_crit.",
    "- On the digits CNN the rule did not remove what it was aimed at: shrinks 10 -> 12 "
    "(norms) and 9 -> 7 (per-example), now by smaller steps. The batch still grows early "
    "on unresolved estimates (an infinite B_noise, 6 and 3 of the changes, has the range "
    "[inf, inf]: the batch doubles) or on transiently high ones (B_noise 100 to 4,618 in "
    "the first 50 steps, against B_crit 19.7), which the rule leaves as they were, and "
    "shrinks back when the estimate falls to 5-10 mid-training: the loss is in that early "
    "growth, not in the speed of the shrink. The seeds move both ways by more than the "
    "rules differ (per-example: 1.12 -> 0.378, 0.437 -> 2.02, 3 -> 4.64), and the fixed "
    "batch's own seeds span 0.818 to 3.47: three seeds do not resolve a difference "
    "between the two rules on this task.",
    "- Reading of the `resolved` rerun (the rule before `target`; every adaptive arm, 3 seeds): on the digits "
    "CNN every adaptive arm's mean falls (norms 2.28 -> 1.09, per-example 2.35 -> 0.658, "
    "lr-kept 3.92 -> 1.28, norms-median 2.24 -> 1.4, per-example-median 3.45 -> 0.517). The "
    "early growth is gone: shrinks 55 -> 1 over the five arms, largest batch 69-155 -> 21-56 "
    "(means), 45-66% fewer examples; the batch stays at 8 until step 33 to 219 (27-38% of "
    "the estimates unresolved), and the runs take 6-38% more steps. Both per-example arms are "
    "below 1 (the warmup 1.28, the fixed batch 1.98); the norms arm (1.09) is not, with one "
    "seed at 2.33.",
    "- On the GPT the rule binds rarely (11-19% of the estimates unresolved): 6 of the 15 "
    "runs are the same run as under `near-end` (batch for batch), and the others move "
    "both ways (norms 1 -> 0.927, per-example 1.2 -> 1.3, norms-median 1.26 -> 1.01, "
    "per-example-median 1.22 -> 1.13), by less than the fixed batch's own seeds span (0.994 "
    "to 1.31). `adaptive-norms` is below 1 (0.927, 2 of 3 seeds).",
    "- The issue's targets, under `resolved`: no one arm is below 1 on both tasks "
    "(`adaptive-norms`: digits 1.09, GPT 0.927; `adaptive-per-example`: 0.658 and 1.3), and "
    "no arm meets \"at most the warmup's steps at no more of its examples\": the adaptive arms "
    "that use fewer examples than the warmup take more steps (digits per-example 2,939 "
    "examples against 5,080, but 230.1 steps against 173.8; GPT norms 2,225 against 2,518, "
    "but 135.7 against 118.2), and those with fewer steps use more examples (GPT per-example: "
    "92.0 steps, 3,049 examples). The schedule, holding its batch until the estimate resolves "
    "and moving only to the near end of the range, sits on the examples-saving side of the "
    "frontier; the warmup, with the grid's best learning rate per batch and a final batch of "
    "64, three times B_crit on the digits CNN, on the steps-saving side.",
    "- Reading of the `target` rerun (this one: the band twice the range, so a rising estimate "
    "is followed at B_noise, k = 1, not B_noise / 2; the main arms, seeds 0-2 against "
    "`resolved` in the table above, then seeds 3-5 for them, the warmup and the fixed batch). "
    "It did what its math says, and no more: on the same seeds every main arm's steps fall by "
    "17-32% and its examples rise by 19-50% (digits norms 267.1 -> 181.5 steps, 3,222 -> 4,320 "
    "examples; per-example 230.1 -> 191.3, 2,939 -> 4,413; GPT norms 135.7 -> 105.9, 2,225 -> "
    "2,649; per-example 92.0 -> 70.9, 3,049 -> 3,684): the runs move along the frontier toward "
    "fewer steps. The frontier values move both ways within the seeds' spread (digits norms "
    "1.09 -> 1.05, per-example 0.658 -> 1.24; GPT norms 0.927 -> 1.15, per-example 1.3 -> "
    "1.2), as the model predicts (k sets the trade; it does not lower the value). The batch "
    "now follows the estimate: each run's last batch is the B_noise of its last change in whole "
    "micro-batches, or the x2 cap per change below it (24-152 against 27-156); the digits runs "
    "leave batch 8 at step 9-90 (under `resolved` 33-219), the GPT's at step 10-50.",
    "- Over 6 seeds: on the digits CNN `adaptive-norms` is below 1 (0.806, 0.147 to 1.67, 4 of 6 "
    "runs below the hyperbola) and meets the warmup target in the means (176.6 steps, 4,055 "
    "examples against 189.0 and 6,056), but seed by seed only in 3 of 6: the warmup's own "
    "seeds span 150-268 steps and 3,538-11,100 examples (frontier value 0.368 to 7.49), the "
    "fixed batch's 0.616 to 3.47. `adaptive-per-example` comes to 1.05 (194.7 steps, 4,151 "
    "examples: 3% more steps than the warmup, 31% fewer examples). On the GPT no adaptive arm "
    "is below 1 (norms 1.16, 1.06 to 1.28, 0 of 6 below the hyperbola; per-example 1.29); the "
    "norms arm takes fewer steps than the warmup of the same seed in 6 of 6 runs (104.9 "
    "against 117.9) but 7% more examples (2,673 against 2,499), both in 2 of 6. The per-example "
    "arm follows the preconditioned B_noise to batch 128-152 (about 3 B_crit): 71.0 steps, as "
    "few as the fixed batch at B_crit (74.5), with more examples (3,851 against 3,499).",
    "- The other adaptive arms under `target` (seeds 0-2, against `resolved` in the table "
    "above): 11-35% fewer steps and 18-78% more examples in each; frontier values digits "
    "lr-kept 1.28 -> 2.49, norms-median 1.4 -> 0.708, per-example-median 0.517 -> 0.991; GPT "
    "norms-median 1.01 -> 1.36, per-example-median 1.13 -> 1.4 (its largest batch 261 on "
    "average, against 136 for the smoothed estimate on those seeds), lr-kept 4.06 -> 7.15 "
    "(largest batch 291 on average, at the start's learning rate).",
    "- The issue's targets, under `target`: no arm is below 1 on both tasks (`adaptive-norms`: "
    "digits 0.806, GPT 1.16), and the warmup target is met by one arm on one task (digits "
    "norms, in the means; 3 of 6 seeds). On the GPT the fixed, warmup and main adaptive arms have a "
    "mean within 1.15-1.29 and seeds within 0.85-1.54: six seeds do not separate them there.",
]
