"""The router's settings: ``CACHET_ROUTER_*``; ``CACHET_API_KEYS`` and ``CACHET_STORE_URL`` are
shared with the bridge and the usage ledger."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, IPvAnyNetwork, field_validator
from pydantic_settings import SettingsConfigDict

from cachet.config import API_KEYS_ALIASES, LOOPBACK, STORE_URL_ALIASES, ServiceSettings, StoreUrl


class RouterSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="CACHET_ROUTER_")

    port: int = Field(default=50091, ge=0, le=65535)
    # Prometheus /metrics over HTTP on this port (docs/ARCHITECTURE.md, "Ports"); 0: none.
    metrics_port: int = Field(default=9091, ge=0, le=65535)
    tokenizer_address: str = f"{LOOPBACK}:50051"
    cache_address: str = f"{LOOPBACK}:50071"
    usage_address: str = f"{LOOPBACK}:50081"
    engine_addresses: list[str] = Field(default_factory=list)
    store_url: StoreUrl = Field(default="", validation_alias=STORE_URL_ALIASES["router"])
    # API key -> account id, e.g. CACHET_API_KEYS='{"sk-test": "acct-1"}' (shared with the bridge).
    # Empty means development mode: every caller is the "anonymous" account.
    api_keys: dict[str, str] = Field(default_factory=dict, validation_alias=API_KEYS_ALIASES["router"])
    # A session id's placement (see placement.py): how much better than its home another
    # replica must score to take the session, and what a new session gives up of a prefix
    # cached for others to land where the sessions hold the least KV.
    session_slack_tokens: float = Field(default=0.0, ge=0)
    new_session_slack_tokens: float = Field(default=32_768.0, ge=0)
    # A session is forgotten (its home and KV footprint) after this long without a request.
    session_idle_seconds: float = Field(default=600.0, gt=0)
    # How long the engines keep the KV of a request with a session id (x-session-affinity or
    # prompt_cache_key) that asks no retention of its own, in preference to other KV: an agent's
    # prefix outlasts the pause while its tool runs (cache_retention.py). The APIs' values:
    # "in_memory" (10 min), "24h", "5m", "1h"; "none" for plain LRU.
    session_cache_retention: Literal["none", "in_memory", "24h", "5m", "1h"] = "in_memory"
    # Cached prompt tokens one queued or running request is worth when scoring replicas.
    load_penalty_tokens: float = Field(default=512.0, ge=0)
    # A token cached in the host tier / the shared file tier, worth this share of one in the
    # engine's pool: the prefill time each saves against a pool hit's, from the measured TTFTs
    # in docs/ARCHITECTURE.md (pool ~0.02x of cold, host 0.02-0.04x, shared ~0.05x on CPU). See
    # placement.PlacementPolicy.
    host_tier_weight: float = Field(default=0.98, ge=0, le=1)
    shared_tier_weight: float = Field(default=0.97, ge=0, le=1)
    # A replica whose last load report is older than this is treated as down. Generous, because
    # a CPU engine busy with a long prefill may report late, and a dropped stream is caught at once.
    report_stale_seconds: float = Field(default=5.0, gt=0)
    # Milliseconds between load reports asked of each engine (0: the engine's default).
    load_report_interval_ms: int = Field(default=0, ge=0)
    # At start, wait at most this long for every engine to report before serving.
    startup_wait_seconds: float = Field(default=10.0, ge=0)
    # Deadline of each call to the tokenizer, cache index and usage services.
    dependency_timeout_seconds: float = Field(default=10.0, gt=0)
    # A finished request's usage record waits at most this long for others to share its
    # RecordUsageBatch call (one ledger fsync for the lot); shutdown sends at once.
    usage_flush_seconds: float = Field(default=0.02, ge=0)
    # The cache index is an optimisation: wait for it only this long before scoring by load.
    cache_timeout_seconds: float = Field(default=0.5, gt=0)
    # Whether each account's cached prefixes are its own (cache_scope.py): shared, a tenant
    # learns from cached-token counts and timing what another sent. false: one cache for all
    # accounts, for a single-tenant deployment.
    cache_isolation: bool = True
    # A max_tokens past what the context window leaves is cut to fit (the answer may end with
    # finish_reason "length"); false: refused with OpenAI's 400 (prompt.check_context_window).
    clamp_max_tokens: bool = True
    # Disaggregated prefill (prefill_handoff): with prefill replicas (CACHET_ENGINE_ROLE), a
    # prompt whose part the chosen decode replica does not hold is at least this many tokens
    # is prefilled on a prefill replica first; shorter ones go straight to the decode replica.
    disagg_min_tokens: int = Field(default=512, ge=1)
    # A shorter prompt, of at least this many tokens the decode replica does not hold, is
    # prefilled on a prefill replica too while the decode replica has requests whose steps it
    # would lengthen, when the prefill replica lacks less than disagg_min_tokens of it and holds
    # only such prompts, under disagg_min_tokens in all (at or above disagg_min_tokens, never:
    # only long prompts are split).
    disagg_idle_min_tokens: int = Field(default=64, ge=1)
    # How long a prefill replica may take before the decode replica computes the prompt itself.
    disagg_prefill_timeout_seconds: float = Field(default=120.0, gt=0)
    # Account id -> cache group: the accounts of one group (an organisation) share cached
    # prefixes, e.g. CACHET_ROUTER_CACHE_GROUPS='{"acct-1": "org-a", "acct-2": "org-a"}'.
    cache_groups: dict[str, str] = Field(default_factory=dict)
    # Accounts that may see every engine replica's load and KV tiers (ListReplicaStatus; the
    # operator section of the bridge's /dashboard), e.g. CACHET_ROUTER_OPERATOR_ACCOUNTS='["ops"]'.
    # The account is the one a key names (CACHET_API_KEYS or `cachet keys create --account`);
    # "anonymous" makes everyone an operator in open development mode. Empty: no operators.
    operator_accounts: frozenset[str] = frozenset()
    # How long a managed API key read from the store is trusted (caller.py): a key revoked
    # with `cachet keys revoke` stops working within this time on every router.
    api_key_cache_seconds: float = Field(default=5.0, ge=0)
    # How long a key's monthly spend summed by the ledger is reused (key_limits.py) before it
    # is asked again; a usage record of the key reaching the ledger through this router
    # drops it at once, so this bounds what the other routers' calls add unseen.
    budget_cache_seconds: float = Field(default=10.0, ge=0)

    # --- async queue (queue_store.py, dispatcher.py, webhooks.py) ---
    # SQLite file of the queue; defaults to <data_dir>/queue.sqlite3. Unused when store_url is set.
    queue_database: Path | None = None
    # Most requests in one queued batch.
    queue_max_batch_requests: int = Field(default=1000, ge=1)
    # A leased job not renewed for this long is taken again (its router is presumed dead).
    queue_lease_seconds: float = Field(default=30.0, gt=0)
    # How often the dispatcher looks for headroom or work when it found none.
    queue_poll_seconds: float = Field(default=0.05, gt=0)
    # Leases after which a job that keeps failing (e.g. crashes its router) ends with an error.
    queue_max_attempts: int = Field(default=5, ge=1)
    # Headroom rule (see dispatcher.py): queued work fills a replica's running batch only up
    # to the limit its engine reports (CACHET_ENGINE_BATCH_MAX_RUNNING_FRACTION), with this
    # many jobs more waiting there, ready for the next seat a job frees...
    batch_prefetch: int = Field(default=4, ge=0)
    # ...or, for an engine that reports no limit, up to this fraction of its
    # max_running_requests, so interactive arrivals find free slots...
    batch_max_running_fraction: float = Field(default=0.75, gt=0, le=1)
    # ...and only while at least this fraction of its KV blocks is free (long batch prompts
    # must not evict the prefixes interactive sessions are about to reuse)...
    batch_min_free_kv_fraction: float = Field(default=0.2, ge=0, lt=1)
    # ...and never while any replica has an interactive request waiting. At most this many
    # queued jobs run at once from this router, whatever the headroom (0: no cap).
    batch_max_in_flight: int = Field(default=0, ge=0)
    # Stored Responses (`store: true`) older than this are purged (response_retention.py), as
    # OpenAI keeps them 30 days; 0: kept until deleted. Checked every purge interval.
    responses_retention_days: float = Field(default=30.0, ge=0)
    responses_purge_interval_seconds: float = Field(default=3600.0, gt=0)
    # HMAC-SHA256 key of webhook signatures; empty: a key made at first start and kept in
    # <data_dir>/webhook_secret (webhook_secret.py). Webhooks are always signed.
    webhook_secret: str = ""
    # Networks webhooks may reach besides public addresses (webhook_targets.py): internal
    # receivers, e.g. CACHET_ROUTER_WEBHOOK_ALLOWED_NETWORKS='["10.1.2.0/24", "127.0.0.1/32"]'.
    # Empty: loopback, private, link-local and reserved addresses are all refused.
    webhook_allowed_networks: list[IPvAnyNetwork] = Field(default_factory=list)
    # Per-attempt HTTP timeout of a webhook call.
    webhook_timeout_seconds: float = Field(default=10.0, gt=0)
    # Retries with exponential backoff and full jitter, from first to max, until the deadline
    # (counted from the batch's end) passes; then the delivery is marked failed.
    webhook_first_backoff_seconds: float = Field(default=1.0, gt=0)
    webhook_max_backoff_seconds: float = Field(default=300.0, gt=0)
    webhook_deadline_seconds: float = Field(default=86400.0, gt=0)
    # Most lines in one OpenAI batch input file (OpenAI's own limit).
    batch_file_max_lines: int = Field(default=50000, ge=1)
    # Account id -> webhook URL called for that account's batches that name none,
    # e.g. CACHET_ROUTER_DEFAULT_WEBHOOKS='{"acct-1": "https://hooks.example/cachet"}'.
    default_webhooks: dict[str, str] = Field(default_factory=dict)

    @field_validator("default_webhooks")
    @classmethod
    def _http_webhooks(cls, webhooks: dict[str, str]) -> dict[str, str]:
        for account, url in webhooks.items():
            if urlsplit(url).scheme not in ("http", "https"):
                raise ValueError(f"default webhook of {account!r} must be an http(s) URL, not {url!r}")
        return webhooks

    @property
    def queue_path(self) -> Path:
        return self.queue_database or self.data_dir / "queue.sqlite3"
