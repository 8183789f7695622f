"""The run page's parity table says, in the cell of a node that lacks a setting, whether
copying the other nodes' value would work there (the finding's ``copy_check``)."""

from __future__ import annotations

from typing import Any

from playwright.sync_api import Page, expect
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.cluster.parity import check_parity
from tests.web.test_run_page import _clone_run, _experiment

SCOPE = {"prefixes": ["NCCL_", "GLOO_"], "names": ["CUDA_VISIBLE_DEVICES"]}


def test_parity_cells_say_whether_copying_the_value_over_would_work(
    page: Page, live_server: str, seeded: dict[str, Any], web_db: sessionmaker[Session]
) -> None:
    def node(name: str, ip: str, env: dict[str, str], ifaces: list[str]) -> dict[str, Any]:
        return {"node": name, "ip": ip, "env": env, "env_scope": SCOPE, "interfaces": ifaces}

    nodes = [
        node(
            "a", "10.0.0.1", {"GLOO_SOCKET_IFNAME": "eth9", "CUDA_VISIBLE_DEVICES": "0"}, ["eth9"]
        ),
        node("b", "10.0.0.2", {}, ["lo", "eth0"]),
        node("c", "10.0.0.3", {}, ["lo", "eth9"]),
    ]
    nodes[1]["gpu_count"] = 1
    report = check_parity(nodes, {"launch_env": {}})
    with web_db.begin() as s:
        run = _clone_run(
            s,
            seeded["real"]["runs"]["baseline#0"],
            _experiment(s, "parity-copy"),
            status="blocked",
            parity=report,
        )
        run_id = run.id
    page.goto(f"{live_server}/runs/{run_id}")
    gloo = page.locator('#parity-table tr[data-field="env.GLOO_SOCKET_IFNAME"]')
    expect(gloo.locator('td[data-node="b"]')).to_contain_text(
        "copying GLOO_SOCKET_IFNAME='eth9' (set on a) would not work here: eth9 is not among "
        "this node's interfaces ['lo', 'eth0']"
    )
    expect(gloo.locator('td[data-node="c"]')).to_contain_text(
        "copying GLOO_SOCKET_IFNAME='eth9' (set on a) would work here"
    )
    # b and c lack CUDA_VISIBLE_DEVICES with no problem of their own (a is the odd one):
    # the cells still tell what copying a's value would do
    cuda = page.locator('#parity-table tr[data-field="env.CUDA_VISIBLE_DEVICES"]')
    expect(cuda.locator('td[data-node="b"] .copy-check')).to_contain_text(
        "device(s) 0 exist among this node's 1 GPU(s)"
    )
    expect(cuda.locator('td[data-node="c"] .copy-check')).to_contain_text(
        "is unknown: this node's GPUs were not counted"
    )
