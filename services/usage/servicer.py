"""The UsageService gRPC servicer: proto → domain → ledger → proto, nothing more.

Validation happens in the domain constructors (``cachet.usage.records``), which
raise ``InvalidArgument`` naming the field; the shared interceptor turns that
into INVALID_ARGUMENT.
"""

from __future__ import annotations

import time

import grpc

from cachet.errors import InvalidArgument
from cachet.tracing import context_from_traceparent, get_tracer
from cachet.usage import metrics
from cachet.usage.ledger import Ledger
from cachet.usage.prices import ModelPrice, PriceTable
from cachet.usage.records import RecordOutcome, UsageEntry, UsageQuery, UsageTotals, parse_group_by
from cachet.usage.v1 import usage_pb2, usage_pb2_grpc

SERVICE_NAME = usage_pb2.DESCRIPTOR.services_by_name["UsageService"].full_name
# The span of one record's write, in the trace of the request it bills.
RECORD_SPAN_NAME = "cachet.usage.record"

_TRACER = get_tracer("cachet.usage")


def entry_from_proto(record: usage_pb2.UsageRecord, now_ms: int) -> UsageEntry:
    """A record as the ledger stores it; an unset finish time is stamped ``now_ms``."""
    return UsageEntry(
        request_id=record.request_id,
        account_id=record.account_id,
        model=record.model,
        session_id=record.session_id,
        prompt_tokens=record.prompt_tokens,
        cached_tokens=record.cached_tokens,
        completion_tokens=record.completion_tokens,
        finished_at_ms=record.finished_at_ms or now_ms,
        replica_address=record.replica_address,
        priority=record.priority,
        api_key_id=record.api_key_id,
    )


def query_from_proto(request: usage_pb2.QueryUsageRequest) -> UsageQuery:
    return UsageQuery(
        account_id=request.account_id,
        model=request.model,
        session_id=request.session_id,
        start_ms=request.start_ms,
        end_ms=request.end_ms,
        group_by=parse_group_by(request.group_by),
        api_key_id=request.api_key_id,
    )


def row_to_proto(totals: UsageTotals) -> usage_pb2.UsageRow:
    return usage_pb2.UsageRow(
        account_id=totals.account_id,
        model=totals.model,
        day=totals.day,
        session_id=totals.session_id,
        requests=totals.requests,
        prompt_tokens=totals.prompt_tokens,
        cached_tokens=totals.cached_tokens,
        completion_tokens=totals.completion_tokens,
        cost_picousd=totals.cost_picousd,
        cache_savings_picousd=totals.cache_savings_picousd,
    )


def outcome_to_proto(outcome: RecordOutcome) -> usage_pb2.RecordUsageResponse:
    return usage_pb2.RecordUsageResponse(duplicate=outcome.duplicate, cost_picousd=outcome.cost_picousd)


def price_to_proto(model: str, price: ModelPrice) -> usage_pb2.ModelPrice:
    return usage_pb2.ModelPrice(model=model, **price.model_dump())


class UsageServicer(usage_pb2_grpc.UsageServiceServicer):
    """Serves one ledger with one price table."""

    def __init__(self, ledger: Ledger, prices: PriceTable) -> None:
        self._ledger = ledger
        self._prices = prices

    async def RecordUsage(
        self, request: usage_pb2.RecordUsageRequest, context: grpc.aio.ServicerContext
    ) -> usage_pb2.RecordUsageResponse:
        entry = entry_from_proto(request.record, now_ms=int(time.time() * 1000))
        price = self._prices.price_for(entry.model)
        outcome = await self._ledger.record(entry, price)
        metrics.observe_record(entry, outcome, price)
        return outcome_to_proto(outcome)

    async def RecordUsageBatch(
        self, request: usage_pb2.RecordUsageBatchRequest, context: grpc.aio.ServicerContext
    ) -> usage_pb2.RecordUsageBatchResponse:
        now_ms = int(time.time() * 1000)
        entries = []
        for index, record in enumerate(request.records):
            try:
                entries.append(entry_from_proto(record, now_ms))
            except InvalidArgument as error:
                # The whole batch is refused, so that nothing of it is half recorded.
                raise InvalidArgument(
                    f"records[{index}].{error.message}", param=f"records[{index}].{error.param}"
                ) from None
        # A span per record in its request's trace: the batch's own call belongs to none of them.
        spans = [
            _TRACER.start_span(
                RECORD_SPAN_NAME,
                context=context_from_traceparent(record.traceparent),
                attributes={"cachet.request_id": record.request_id},
            )
            for record in request.records
        ]
        try:
            outcomes = await self._ledger.record_many(
                [(entry, self._prices.price_for(entry.model)) for entry in entries]
            )
        finally:
            for span in spans:
                span.end()
        for entry, outcome in zip(entries, outcomes, strict=True):
            metrics.observe_record(entry, outcome, self._prices.price_for(entry.model))
        return usage_pb2.RecordUsageBatchResponse(results=[outcome_to_proto(outcome) for outcome in outcomes])

    async def QueryUsage(
        self, request: usage_pb2.QueryUsageRequest, context: grpc.aio.ServicerContext
    ) -> usage_pb2.QueryUsageResponse:
        rows = await self._ledger.query(query_from_proto(request))
        return usage_pb2.QueryUsageResponse(rows=[row_to_proto(row) for row in rows])

    async def ListPrices(
        self, request: usage_pb2.ListPricesRequest, context: grpc.aio.ServicerContext
    ) -> usage_pb2.ListPricesResponse:
        return usage_pb2.ListPricesResponse(
            prices=[price_to_proto(model, price) for model, price in self._prices.models.items()],
            default_price=price_to_proto("", self._prices.default),
        )
