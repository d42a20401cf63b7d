"""Tests of the Prometheus side of tests/deploy/pod_sim.py: its text-format (0.0.4) parser and
its scrape against a local HTTP server, so that a daemon answering wrongly is caught (the
simulation itself runs in tests/deploy/check-kubernetes.sh with a built gpurpcd).

    python3 -m pytest tests/deploy -q -p no:cacheprovider
"""
from __future__ import annotations

import http.server
import os
import sys
import threading
from typing import Iterator, List, Tuple

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pod_sim  # noqa: E402

GOOD = """\
# HELP gpurpc_rpcs_total gRPC calls
# TYPE gpurpc_rpcs_total counter
gpurpc_rpcs_total{method="/gpurpc.v1.DeviceService/GetServerInfo",code="OK"} 3
gpurpc_rpcs_total{method="unknown",code="NOT_FOUND"} 1
# TYPE gpurpc_rpc_duration_seconds histogram
gpurpc_rpc_duration_seconds_bucket{method="m",le="0.0001"} 0
gpurpc_rpc_duration_seconds_bucket{method="m",le="+Inf"} 2
gpurpc_rpc_duration_seconds_sum{method="m"} 1.5e-03
gpurpc_rpc_duration_seconds_count{method="m"} 2
# a plain comment
# TYPE gpurpc_device_info gauge
gpurpc_device_info{device="0",name="a \\"fake\\" device\\\\x\\nnext",} 1
# TYPE gpurpc_start_time_seconds gauge
gpurpc_start_time_seconds 1796100782.896003 1700000000000
# TYPE gpurpc_draining gauge
gpurpc_draining 0
"""


def test_parses_the_text_format() -> None:
    samples = pod_sim.parse_exposition(GOOD)
    assert len(samples) == 9
    assert samples[0] == ("gpurpc_rpcs_total",
                          {"method": "/gpurpc.v1.DeviceService/GetServerInfo", "code": "OK"},
                          3.0)
    assert ("gpurpc_rpc_duration_seconds_bucket", {"method": "m", "le": "+Inf"},
            2.0) in samples
    assert ("gpurpc_rpc_duration_seconds_sum", {"method": "m"}, 0.0015) in samples
    info = [ls for n, ls, _ in samples if n == "gpurpc_device_info"]
    assert info == [{"device": "0", "name": 'a "fake" device\\x\nnext'}]
    assert pod_sim.sample_sum(samples, "gpurpc_rpcs_total") == 4
    assert pod_sim.sample_sum(samples, "gpurpc_rpcs_total", code="OK") == 3
    assert pod_sim.sample_sum(samples, "gpurpc_rpcs_total", code="CANCELLED") is None
    assert pod_sim.sample_sum(samples, "gpurpc_start_time_seconds") == 1796100782.896003


@pytest.mark.parametrize("text, message", [
    ("# TYPE x gauge\nx 1", "does not end in a newline"),
    ("x 1\n", "no TYPE line before the sample of x"),
    ("# TYPE x gauge\nx_sum 1\n", "no TYPE line before the sample of x_sum"),
    ("# TYPE x gauge\n# TYPE x counter\n", "a second TYPE for x"),
    ("# TYPE x gauges\n", "not one of the types"),
    ("# TYPE 1x gauge\n", "'1x' is not a metric name"),
    ("# TYPE x gauge\nx{a=\"1\"b=\"2\"} 1\n", "not a sample"),
    ("# TYPE x gauge\nx{a=\"1\",a=\"2\"} 1\n", "label a twice"),
    ("# TYPE x gauge\nx{a=1} 1\n", "not a sample"),
    ("# TYPE x gauge\nx{a=\"\\q\"} 1\n", "not a sample"),
    ("# TYPE x gauge\nx one\n", "not a sample"),
    ("# TYPE x gauge\nx  1\n", "not a sample"),
    ("# TYPE x histogram\nx_bucket 1\n", "a histogram bucket without le"),
])
def test_refuses_what_a_scraper_would(text: str, message: str) -> None:
    with pytest.raises(pod_sim.SimError, match=message):
        pod_sim.parse_exposition(text)


class _Handler(http.server.BaseHTTPRequestHandler):
    answers: dict = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        status, content_type, body = self.answers.get(self.path, (404, "text/plain", "no"))
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def server() -> Iterator[Tuple[str, dict]]:
    answers: dict = {}
    handler = type("Handler", (_Handler,), {"answers": answers})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", answers
    finally:
        httpd.shutdown()
        httpd.server_close()


PROM = "text/plain; version=0.0.4; charset=utf-8"


def test_scrape(server: Tuple[str, dict]) -> None:
    url, answers = server
    answers["/metrics"] = (200, PROM, GOOD)
    samples: List[pod_sim.Sample] = pod_sim.scrape(url + "/metrics")
    assert pod_sim.sample_sum(samples, "gpurpc_draining") == 0


@pytest.mark.parametrize("path, answer, message", [
    ("/missing", None, "HTTP Error 404"),
    ("/metrics", (200, "application/json", GOOD), "is not the Prometheus text format"),
    ("/metrics", (200, "text/plain; charset=utf-8", GOOD), "is not the Prometheus text"),
    ("/metrics", (200, PROM, "# TYPE other gauge\nother 1\n"), "no gpurpc_ metric"),
    ("/metrics", (200, PROM, "gpurpc_x 1\n"), "no TYPE line"),
])
def test_scrape_refuses(server: Tuple[str, dict], path: str, answer: tuple,
                        message: str) -> None:
    url, answers = server
    if answer is not None:
        answers[path] = answer
    with pytest.raises(pod_sim.SimError, match=message):
        pod_sim.scrape(url + path)


def test_scrape_refuses_a_closed_port() -> None:
    port = pod_sim.free_port()  # nothing listens there
    with pytest.raises(pod_sim.SimError, match=f"GET http://127.0.0.1:{port}/metrics"):
        pod_sim.scrape(f"http://127.0.0.1:{port}/metrics")
