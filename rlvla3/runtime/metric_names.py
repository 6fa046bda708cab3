"""Every counter and gauge the roles publish, with what it means.

Counters are run-wide sums in Redis (``Role.count``, ``Role.drop``; each role also shows its own
share among its gauges). Gauges are one role instance's current values, published with its
heartbeat (``Role.gauge``). A name that is not listed here is refused when a role uses it, so
this list and ``docs/metrics.md`` (generated from it: ``python -m rlvla3.reference``) stay
complete.
"""

from __future__ import annotations

COUNTERS: dict[str, str] = {
    # env workers
    "env_steps": "simulator steps taken",
    "episodes": "episodes finished",
    "chunks_produced": "trajectory chunks pushed towards a trainer",
    "chunks_resent": "chunks pushed again to a restarted trainer because no trainer had settled them",
    "chunks_resend_overflow": "chunks an env's resend buffer let go unsettled to stay within resend_buffer_chunks (a restarted trainer cannot get them again)",
    "action_requests": "action requests sent to rollout servers",
    "action_wait_us": "time envs waited for actions, in µs (÷ action_requests: the mean round trip)",
    "env_step_us": "time spent in the simulators' step, in µs",
    "request_timeouts": "action requests unanswered within request_timeout_s and re-sent",
    "bad_replies": "rollout servers' replies refused by an env worker: rows that do not match the request, non-finite or absurd (beyond 1e6) log-probs, values or continuous actions, an impossible policy_version (the request is re-sent)",
    "backpressure_pauses": "times envs paused because too many chunks waited for a trainer",
    "sim_faults": "simulator steps or resets that returned NaN/inf or absurdly large numbers (rlvla3/algo/number_limits.py; episode cut, env reset)",
    # eval env worker (periodic evaluation, run.eval)
    "eval_env_steps": "simulator steps of periodic evaluation (not in env_steps)",
    "eval_episodes": "held-out episodes finished by periodic evaluation, or protocol episodes by `rlvla3 eval`",
    "eval_bad_episodes": "protocol episodes refused by an eval env worker (not an episode `rlvla3 eval` queues)",
    "eval_rounds": "periodic evaluations recorded (one weight version each)",
    "eval_rounds_void": "evaluations given up because the eval rollout server changed weights mid-round (it restarted)",
    # rollout servers
    "requests_served": "action requests answered",
    "bad_requests": "requests refused: not an observation request, wrong shape or dtype, NaN/inf or absurdly large floats",
    "weight_relinks": "times a rollout server re-formed its weight link",
    "weight_links_failed": "weight links the broadcaster could not form: no server joined within link_timeout_s (a stale record, or a server linked to another store), or the first send failed; not tried again under that id",
    "weight_sends_late": "weight sends to one rollout server that outlived the broadcaster's send_deadline_s (the server frozen or slow; its link waits aside until the send ends)",
    # trainers
    "chunks_received": "chunks a trainer took off its queue",
    "chunks_consumed": "chunks trained on",
    "chunks_dropped": "chunks dropped: too stale, or refused by the chunk checks",
    "chunks_in_flight_at_exit": "chunks still buffered or queued when a trainer stopped",
    "chunks_lost_in_trainer": "chunks in a killed trainer's buffer that no resend buffer keeps (env workers' resend_buffer_chunks 0; its successor writes them off)",
    "chunks_returned": "chunks in a killed trainer's buffer, handed back to their producers to resend (its successor counts them; they count as received again when they arrive, and as lost if their producer's full resend buffer had let them go)",
    "chunks_duplicate": "resent chunks a trainer had already received or settled: dropped, each once",
    "chunks_written_off": "chunks counted as pushed that a trainer found would never arrive",
    "bad_chunks": "chunks refused by the chunk checks (also in chunks_dropped)",
    "bad_chunks_unattributed": "refused chunks whose producer or number could not go into the chunk ledger, or (multi-host) whose tag is not their env worker's (of bad_chunks; produced and dropped each itself)",
    "samples_consumed": "env steps trained on",
    "samples_dropped": "env steps in dropped chunks",
    "updates": "PPO updates",
    "trained_staleness_0": "env steps trained on that the trainer's current version produced",
    "trained_staleness_1": "env steps trained on that lagged 1 version behind the trainer",
    "trained_staleness_2": "env steps trained on that lagged 2 versions behind the trainer",
    "trained_staleness_3plus": "env steps trained on that lagged 3 or more versions behind",
    "nonfinite_minibatches": "optimizer steps skipped for non-finite gradients",
    "sft_samples": "demonstration samples the SFT trainer trained on",
    "checkpoint_failures": "checkpoints not written (a full disk): the older ones stay",
    # weights
    "weights_rejected": "weight versions refused by the broadcaster, a rollout server or a restarted trainer: size, layout or dtype, a version not newer or no trainer produced, an HMAC that does not match the run's weights key, NaN or inf",
    "weights_unsent": "weight versions the broadcaster had no room for within a second (resent)",
    # any role
    "bad_frames": "messages that failed to decode, or of a type the socket does not take",
    "auth_refused": "peers refused for not holding the run's secret (CURVE handshakes), and messages from a peer no ZAP handler admitted",
    # launcher
    "role_restarts": "role processes the launchers restarted",
    "redis_restarts": "times the head restarted the run's own redis-server from its append-only file",
    "role_stalls": "running roles killed (and restarted) for finishing no step in run.stall_timeout_s",
}

GAUGES: dict[str, str] = {
    "steps_per_s": "env worker: env steps per second over the last 5 s",
    "chunks_queued": "env worker: chunks pushed and not yet received by a trainer (run-wide)",
    "max_chunks_queued": "env worker: its back-pressure limit on chunks_queued (0: off)",
    "envs": "env worker: the envs it runs",
    "requests_per_s": "rollout server: requests per second over the last 5 s",
    "batch_fill": "rollout server: last batch's size / its largest (max_batch, or every env in sync)",
    "queue_wait_ms": "rollout server: how long the last batch waited to fill, in ms",
    "policy_version": "the weight version the role serves, trains or broadcasts",
    "staleness": "trainer: versions the last accepted chunk lagged behind the trainer",
    "samples_per_s": "trainer: samples trained per second over the last 20 s",
    "policy_loss": "trainer: the last update's policy loss",
    "steps": "SFT trainer: steps so far",
    "loss": "SFT trainer: the last step's loss",
    "tokens_per_s": "SFT trainer: packed tokens per second over the last 20 s",
    "links": "weight broadcaster: live weight links (one per rollout server)",
    "last_sync_ms": "weight broadcaster: how long the last broadcast took, in ms (links late past the send deadline not waited for)",
    "weights_check_ms": "weight broadcaster, rollout server: how long checking the last weight version took (its HMAC over the buffer, finiteness), in ms",
}
