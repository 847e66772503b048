"""A Ray cluster of two nodes on this machine (``ray.cluster_utils.Cluster``, the way Ray tests multi-node
behaviour): ``Scale(backend="ray", ray_address=...)`` spreads a universe's alignments over both nodes,
says which node aligned which reply (in each transform's info and in the round's record), and merges
what the sequential path merges."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from test_scale import _copies, _max_diff, _same_transforms, _strategy_round

from fedlmc.merging.universe import universe_merge
from fedlmc.options import Matching, Scale, Universe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture
def two_nodes(tmp_path_factory):
    """A head and a second node of 1 CPU each, short socket paths, stopped after the test."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    for old in Path("/tmp").glob(f"rc-{os.getuid()}-*"):  # what an earlier run's exiting processes left
        if not Path(f"/proc/{old.name.rsplit('-', 1)[1]}").exists():
            shutil.rmtree(old, ignore_errors=True)
    temp = f"/tmp/rc-{os.getuid()}-{os.getpid()}"
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "temp_dir": temp},
    )
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def test_alignments_spread_over_both_nodes_of_a_ray_cluster(two_nodes, tmp_path, record):
    models = _copies(8)
    m = Matching(keep_identity=False)
    u = Universe(iterations=2, keep_layernorm=False)
    seq, T_seq = universe_merge(models, matching=m, universe=u)
    scale = Scale(workers=2, backend="ray", ray_address=two_nodes.address, spool_dir=str(tmp_path))
    par, T_par = universe_merge(models, matching=m, universe=u, scale=scale)
    record("universe aligned on a 2-node Ray cluster vs sequential (max |Δ|)", _max_diff(seq, par), 1e-10)
    _same_transforms(T_seq, T_par, record, "2-node Ray cluster")
    cluster_nodes = {n.node_id for n in two_nodes.list_all_nodes()}
    used = {T.info["node"] for T in T_par[1:]}
    assert len(cluster_nodes) == 2 and used == cluster_nodes, (used, cluster_nodes)
    assert all(T.info["worker_peak_rss_mb"] > 0 for T in T_par[1:])


def test_the_rounds_record_says_which_node_aligned_how_many_replies(two_nodes, tmp_path):
    scale = Scale(workers=2, backend="ray", ray_address=two_nodes.address, spool_dir=str(tmp_path))
    _, rec = _strategy_round(scale, n=8)
    cluster_nodes = {n.node_id for n in two_nodes.list_all_nodes()}
    assert set(rec["aligned_on"]) == cluster_nodes and sum(rec["aligned_on"].values()) >= 7, rec["aligned_on"]
    assert rec["excluded"] == [] and rec["kept"] == "aligned"


@pytest.mark.timeout(600)
def test_a_flower_simulation_runs_on_an_existing_ray_cluster(two_nodes, monkeypatch):
    """Flower's simulation engine calls ``ray.init`` without an address, which joins the cluster named by
    ``RAY_ADDRESS`` (set where ``flwr run`` starts the local SuperLink): the quickstart app's 2 clients,
    one CPU each, run as actors on both nodes and AlignedFedAvg aggregates both replies (one round of 2 local steps)."""
    import ray
    from test_simulation import _short_tmp, _stop_local_superlink, run_example

    monkeypatch.setenv("RAY_ADDRESS", two_nodes.address)
    home = _short_tmp("rc-flwr-")
    try:
        out = run_example(
            "quickstart", "strategy='aligned' num-server-rounds=1 local-steps=2", home, "client-resources-num-cpus=1"
        )
        assert out.count("Received 2 results and 0 failures") == 1, out[-3000:]
    finally:
        _stop_local_superlink(home)
        shutil.rmtree(home, ignore_errors=True)
    ray.init(address=two_nodes.address, include_dashboard=False, log_to_driver=False)
    actors = [a for a in ray._private.state.actors().values() if "ClientAppActor" in a.get("ActorClassName", "")]
    ray.shutdown()
    nodes = {a["Address"]["NodeID"] for a in actors}
    assert nodes == {n.node_id for n in two_nodes.list_all_nodes()}, actors
