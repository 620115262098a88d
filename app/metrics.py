"""Prometheus metrics (`GET /metrics`): this gateway's own, and the workers' as they advertise them.

Every gateway reports the workers' numbers (read from the worker registry in Redis), so one
scrape of any gateway sees the whole deployment; the `streamvqa_gateway_*` series are per
gateway process.
"""

import itertools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from streamvqa import protocol
from streamvqa.protocol import Answer, WorkerInfo

LATENCY_BUCKETS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "streamvqa_gateway_http_requests", "HTTP requests answered.", ["method", "route", "status"], registry=r
        )
        self.sessions_created = Counter("streamvqa_gateway_sessions_created", "Sessions created.", registry=r)
        self.questions = Counter(
            "streamvqa_gateway_questions", "Questions submitted, by how they were asked.", ["via"], registry=r
        )
        self.answers = Counter(
            "streamvqa_gateway_answers", "Answers delivered, by outcome.", ["outcome"], registry=r
        )
        self.ttft = Histogram(
            "streamvqa_gateway_ttft_seconds", "From a question reaching the gateway to its first answer token.",
            buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.answer_time = Histogram(
            "streamvqa_gateway_answer_seconds", "From a question reaching the gateway to its last answer token.",
            buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.stream_bytes = Counter(
            "streamvqa_gateway_stream_bytes", "Media bytes received on stream sockets.", registry=r
        )
        self.upload_bytes = Counter("streamvqa_gateway_upload_bytes", "Upload bytes moved into Redis.", registry=r)
        self.stream_sockets = Gauge("streamvqa_gateway_stream_sockets", "Stream sockets open now.", registry=r)
        self.rate_limited = Counter(
            "streamvqa_gateway_rate_limited", "Requests and sockets refused for going over a rate.", registry=r
        )

    def answered(self, answer: Answer) -> None:
        self.answers.labels("done").inc()
        if answer.ttft_ms is not None:
            self.ttft.observe(answer.ttft_ms / 1000)
        if answer.total_ms is not None:
            self.answer_time.observe(answer.total_ms / 1000)

    def render(self, workers: list[WorkerInfo]) -> bytes:
        cluster = CollectorRegistry()
        cluster.register(_WorkersCollector(workers))
        return generate_latest(self.registry) + generate_latest(cluster)


class _WorkersCollector:
    def __init__(self, workers: list[WorkerInfo]) -> None:
        self.workers = workers

    def collect(self):
        alive = [w for w in self.workers if w.alive]
        count = GaugeMetricFamily("streamvqa_workers", "Live workers, by model.", labels=["model"])
        for model in sorted({w.model for w in alive}):
            count.add_metric([model], sum(w.model == model for w in alive))
        yield count
        families = (
            (GaugeMetricFamily, "streamvqa_worker_sessions", "Sessions the worker holds.", lambda w: w.sessions),
            (GaugeMetricFamily, "streamvqa_worker_max_sessions", "Sessions the worker may hold.", lambda w: w.max_sessions),
            (GaugeMetricFamily, "streamvqa_worker_kv_free_bytes", "Cache memory its sessions have not reserved.", lambda w: w.kv_free_bytes),
            (GaugeMetricFamily, "streamvqa_worker_kv_pool_pages", "Pages of its KV pool, allocated once at start.", lambda w: w.pool_pages),
            (GaugeMetricFamily, "streamvqa_worker_kv_pool_free_pages", "Pages of its KV pool no session leases.", lambda w: w.pool_free_pages),
            (GaugeMetricFamily, "streamvqa_worker_kv_pool_page_tokens", "Cache tokens a page of its KV pool holds.", lambda w: w.pool_page_tokens),
            (GaugeMetricFamily, "streamvqa_worker_kv_pool_bytes", "Bytes of its KV pool (keys, values and rotated keys of every page).", lambda w: w.pool_bytes),
            (GaugeMetricFamily, "streamvqa_worker_host_pool_pages", "Pages of its host pool (host tiers), allocated once at start.", lambda w: w.host_pool_pages),
            (GaugeMetricFamily, "streamvqa_worker_host_pool_free_pages", "Pages of its host pool no session leases.", lambda w: w.host_pool_free_pages),
            (GaugeMetricFamily, "streamvqa_worker_host_pool_bytes", "Bytes of its host pool, in host memory.", lambda w: w.host_pool_bytes),
            (CounterMetricFamily, "streamvqa_worker_frames_ingested", "Frames appended to caches since the worker started.", lambda w: w.frames_ingested),
            (CounterMetricFamily, "streamvqa_worker_evictions", "Cache evictions since the worker started.", lambda w: w.evictions),
            (CounterMetricFamily, "streamvqa_worker_answers", "Answers finished since the worker started.", lambda w: w.answers),
            (GaugeMetricFamily, "streamvqa_worker_ingest_lag_seconds", "The largest live ingest lag among its sessions.", lambda w: w.ingest_lag_s),
            (GaugeMetricFamily, "streamvqa_worker_host_tier_bytes", "Host memory its sessions' host tiers take (recall).", lambda w: w.host_bytes),
            (GaugeMetricFamily, "streamvqa_worker_host_free_bytes", "Host tier memory its sessions have not reserved.", lambda w: w.host_free_bytes),
            (CounterMetricFamily, "streamvqa_worker_retrieved_tokens", "Host tier tokens brought back per layer for questions.", lambda w: w.retrieved_tokens),
            (CounterMetricFamily, "streamvqa_worker_retrieved_pages", "Host tier pages that questions borrowed from, in the first layer.", lambda w: w.retrieved_pages),
            (CounterMetricFamily, "streamvqa_worker_retrieval_seconds", "Time spent choosing host pages and bringing them back.", lambda w: w.retrieval_ms / 1000),
            (CounterMetricFamily, "streamvqa_worker_steps", "Engine steps: of questions starting, of answer tokens, of frames.", lambda w: w.steps),
            (CounterMetricFamily, "streamvqa_worker_step_sessions", "Sessions those steps ran in one forward, summed: over steps, the mean batch.", lambda w: w.step_sessions),
            (CounterMetricFamily, "streamvqa_worker_prompt_tokens", "Question tokens prefilled, with their turns' markers (an answer's usage.prompt_tokens).", lambda w: w.prompt_tokens),
            (CounterMetricFamily, "streamvqa_worker_generation_tokens", "Answer tokens generated (an answer's tokens, usage.completion_tokens).", lambda w: w.generation_tokens),
        )
        for kind, name, help_text, value in families:
            family = kind(name, help_text, labels=["worker", "model"])
            for w in alive:
                family.add_metric([w.id, w.model], value(w))
            yield family
        histograms = (
            ("streamvqa_worker_queue_time_seconds", "From a question reaching the gateway to its worker starting it.", lambda w: w.queue_time_s),
            ("streamvqa_worker_time_per_output_token_seconds", "Per answer of two tokens or more, the mean time between its tokens after the first.", lambda w: w.time_per_output_token_s),
            ("streamvqa_worker_step_batch_sessions", "Sessions each engine step ran in one forward (questions starting, answer tokens, frames).", lambda w: w.step_batch_sessions),
        )
        for name, help_text, value in histograms:
            family = HistogramMetricFamily(name, help_text, labels=["worker", "model"])
            for w in alive:
                if (histogram := value(w)) is not None:
                    family.add_metric([w.id, w.model], _buckets(histogram), histogram.sum)
            yield family


def _buckets(histogram: protocol.Histogram) -> list[tuple[str, float]]:
    """Prometheus's cumulative buckets, by upper bound, the last one +Inf."""
    bounds = [floatToGoString(bound) for bound in histogram.bounds] + ["+Inf"]
    return list(zip(bounds, itertools.accumulate(histogram.counts), strict=True))


class RequestCounter:
    """ASGI middleware counting HTTP requests by method, route template and status."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", None) or "static"
            self.metrics.requests.labels(scope["method"], route, str(status[0])).inc()
