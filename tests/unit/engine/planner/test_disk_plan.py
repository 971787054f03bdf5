"""The disk tier in the spec, the plan, the pod and the launcher: sized from the model,
bounded, refused with the field named."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from spillway_cli import main as cli
from spillway_engine.planner.offload_geometry import FS_BLOCK_BYTES
from spillway_engine.planner.plan import PlanRefused, PlanRequest, make_plan
from spillway_engine.quantity import parse_bytes
from spillway_engine.seam import DISK_TIER_MOUNT
from spillway_operator.flow import render
from spillway_operator.flow.spec import InferenceDeploymentSpec
from tests.unit.planner_fixtures import MODELS, load_model

GiB = 2**30
OWNER = render.Owner("chat", "team-a", "uid-1")
# one group; six groups (SWA + full); GDN hybrid (Mamba states); MLA
FIXTURES = ["llama-3.2-1b", "gemma-3-12b-it", "qwen3-next-80b-a3b-instruct", "deepseek-v2-lite"]


def plan(name="gemma-3-12b-it", **request):
    request = {"model_name": name, "cpu_memory_bytes": 8 * GiB, **request}
    return make_plan(load_model(name), PlanRequest(**request))


@pytest.mark.parametrize("name", FIXTURES)
def test_the_disk_tier_is_sized_from_the_groups(name):
    p = plan(name, disk_bytes=200 * GiB)
    d = p.disk
    assert d is not None and p.kv_connector_extra_config == plan(name).kv_connector_extra_config
    # a chunk's file is its host rows: units x the shared region's page-rounded row
    assert len(d.file_bytes) == len(p.spillway.groups)
    for size, g in zip(d.file_bytes, p.spillway.groups, strict=True):
        assert size % FS_BLOCK_BYTES == 0
        assert g.chunk_bytes <= size
        assert size == g.units * -(-(p.spillway.unit_bytes * p.spillway.copies)
                                   // FS_BLOCK_BYTES) * FS_BLOCK_BYTES
        assert size <= g.row_bytes + g.units * FS_BLOCK_BYTES
    assert d.chunk_set_bytes == sum(d.file_bytes)
    assert d.num_chunks == d.budget_bytes_per_engine // d.chunk_set_bytes
    assert d.capacity_tokens == d.num_chunks * p.spillway.chunk_tokens
    # the disk holds ~25x the 8 GiB pool: same bytes per token within the padding
    assert 20 * p.capacity_tokens < d.capacity_tokens < 26 * p.capacity_tokens
    assert d.hash_algo == "sha256" and len(d.cache_key) == 16


@given(size=st.integers(min_value=1, max_value=2**44), dp=st.integers(1, 8),
       writers=st.integers(1, 16))
@settings(max_examples=200, deadline=None)
def test_the_budget_never_exceeds_the_share_and_leaves_room_for_a_write(size, dp, writers):
    request = dict(disk_bytes=size, disk_writers=writers, data_parallel_size=dp)
    try:
        d = plan("llama-3.2-1b", **request).disk
    except PlanRefused as e:
        assert "offload.disk.size" in e.reason
        assert size // (dp * writers) < 2 * 8 * 2**20  # the chunk set is 8 MiB here
        return
    assert d.volume_bytes_per_engine == size // (dp * writers)
    assert d.num_chunks * d.chunk_set_bytes <= d.budget_bytes_per_engine
    assert d.volume_bytes_per_engine - d.budget_bytes_per_engine >= d.chunk_set_bytes
    assert d.num_chunks >= 1


def test_a_disk_below_one_chunk_of_every_group_is_refused_naming_the_field():
    with pytest.raises(PlanRefused, match=r"offload.disk.size \(--disk\): .* below one chunk "
                       r"of every group \(100663296 bytes on disk\)"):
        plan(disk_bytes=150 * 2**20)
    with pytest.raises(PlanRefused, match=r"for 1 engine\(s\) x 4 writer\(s\)"):
        plan(disk_bytes=600 * 2**20, disk_writers=4)
    with pytest.raises(PlanRefused, match="under Spillway's offloader only"):
        plan("llama-3.2-1b", disk_bytes=200 * GiB, offloader="upstream")


def test_the_cache_key_changes_with_what_the_files_hold():
    key = plan(disk_bytes=200 * GiB).disk.cache_key
    assert plan(disk_bytes=400 * GiB, disk_writers=2).disk.cache_key == key  # only sizes
    assert plan(disk_bytes=200 * GiB, cpu_memory_bytes=16 * GiB).disk.cache_key == key
    assert plan(disk_bytes=200 * GiB, kv_cache_dtype="fp8").disk.cache_key != key
    assert plan(disk_bytes=200 * GiB, blocks_per_chunk=8).disk.cache_key != key
    assert plan(disk_bytes=200 * GiB, tensor_parallel_size=2).disk.cache_key != key
    assert plan(disk_bytes=200 * GiB, model_name="other/fine-tune").disk.cache_key != key


def test_spillway_plan_prints_both_tiers(capsys):
    code = cli.main(["plan", "--model-config", str(MODELS / "gemma-3-12b-it.json"),
                     "--cpu-memory", "64Gi", "--disk", "500Gi"])
    out = capsys.readouterr().out
    assert code == 0
    assert "Disk tier  500.00 GiB volume; per engine 500.00 GiB, budget 490.00 GiB" in out
    assert "5226 chunks, 1337856 tokens per engine" in out
    assert "Held       host 174592 + disk 1337856 = 1512448 tokens per engine" in out


def spec_of(disk, **fields):
    return InferenceDeploymentSpec.model_validate(
        {"model": {"name": "google/gemma-3-12b-it"}, "offload": {"disk": disk}, **fields})


def pod_of(spec):
    p = make_plan(load_model("gemma-3-12b-it"), spec.plan_request())
    return render.deployment(OWNER, spec, p)["spec"]["template"]["spec"], p


def test_an_emptydir_tier_is_bounded_and_requested_from_the_node():
    pod, p = pod_of(spec_of({"size": "100Gi"}))
    vol = next(v for v in pod["volumes"] if v["name"] == "kv-disk")
    assert parse_bytes(vol["emptyDir"]["sizeLimit"]) == 100 * GiB == p.disk.volume_bytes
    c = pod["containers"][0]
    assert {"name": "kv-disk", "mountPath": DISK_TIER_MOUNT} in c["volumeMounts"]
    assert parse_bytes(c["resources"]["requests"]["ephemeral-storage"]) == 100 * GiB
    assert "ephemeral-storage" not in c["resources"]["limits"]


def test_an_ephemeral_claim_per_pod_from_a_storage_class():
    pod, _ = pod_of(spec_of({"size": "1Ti", "volume": "Ephemeral",
                             "storageClassName": "local-nvme"}))
    vol = next(v for v in pod["volumes"] if v["name"] == "kv-disk")
    claim = vol["ephemeral"]["volumeClaimTemplate"]
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "storageClassName": "local-nvme",
                             "resources": {"requests": {"storage": "1Ti"}}}
    assert claim["metadata"]["labels"] == render.selector_labels(OWNER)
    assert "ephemeral-storage" not in pod["containers"][0]["resources"]["requests"]


def test_a_shared_claim_is_split_between_the_most_replicas_that_may_run():
    spec = spec_of({"size": "1Ti", "volume": "SharedPVC", "claimName": "kv-shared"},
                   autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 4})
    pod, p = pod_of(spec)
    vol = next(v for v in pod["volumes"] if v["name"] == "kv-disk")
    assert vol["persistentVolumeClaim"] == {"claimName": "kv-shared"}
    assert p.disk.writers == 4 and p.disk.volume_bytes_per_engine == 256 * GiB
    # scaling within maxReplicas changes no plan (and so rolls no pod)
    assert spec_of(spec.offload.disk.model_dump(by_alias=True), replicas=3,
                   autoscaling={"enabled": True, "maxReplicas": 4}
                   ).plan_request() == spec.plan_request().model_copy(update={})
    assert spec_of({"size": "1Ti"}, replicas=3).disk_writers == 1  # a pod's own volume


def test_no_disk_tier_renders_no_volume():
    pod, p = pod_of(InferenceDeploymentSpec.model_validate(
        {"model": {"name": "google/gemma-3-12b-it"}}))
    assert p.disk is None
    assert all(v["name"] != "kv-disk" for v in pod["volumes"])


@pytest.mark.parametrize(("disk", "extra", "needle"), [
    ({"size": "0"}, {}, "must be a positive quantity"),
    ({"size": "2Pi"}, {}, "beyond any node"),
    ({"size": "1Ti", "volume": "SharedPVC"}, {}, "claimName is required with volume SharedPVC"),
    ({"size": "1Ti", "claimName": "x"}, {}, "claimName is required with volume SharedPVC"),
    ({"size": "1Ti", "storageClassName": "nvme"}, {}, "only for volume Ephemeral"),
    ({"size": "1Ti", "volume": "Tape"}, {}, "EmptyDir"),
    ({"size": "1Ti"}, {"offloader": "upstream"}, "under offloader spillway only"),
])
def test_the_spec_model_refuses_what_admission_refuses(disk, extra, needle):
    with pytest.raises(ValidationError, match=needle):
        InferenceDeploymentSpec.model_validate(
            {"model": {"name": "m"}, "offload": {"disk": disk, **extra}})


def test_the_launcher_adds_the_tier_the_plan_sizes():
    from spillway_engine.launcher import serve
    from spillway_engine.seam import EngineOptions

    p = plan(disk_bytes=200 * GiB, disk_writers=2)
    config, notes = serve.transfer_config(p, EngineOptions(model="m"), "/mnt/kv")
    (tier,) = config["kv_connector_extra_config"]["secondary_tiers"]
    assert tier["type"] == "SpillwayDiskTier" and tier["root_dir"] == "/mnt/kv"
    assert tier["module_path"] == "spillway_engine.offloader.disk_tier"
    assert tier["budget_bytes"] == p.disk.budget_bytes_per_engine
    assert tier["plan_key"] == p.disk.cache_key
    assert tier["stale_temp_s"] > 0  # a shared folder: another writer's temp files stay
    assert tier["locality"] == "REMOTE"  # ReadWriteMany: vLLM's network water marks
    assert any(n.startswith("disk tier: ") for n in notes)
    config, _ = serve.transfer_config(plan(), EngineOptions(model="m"))
    assert "secondary_tiers" not in config["kv_connector_extra_config"]
    tuned = serve.disk_tier_config(p, "/kv", {serve.DISK_TIER_OPTIONS_ENV:
                                              '{"n_write_threads": 8}'})
    assert tuned["n_write_threads"] == 8
    for bad, why in (("[1]", "JSON object"), ('{"budget_bytes": 1}', "budget_bytes"),
                     ("{", "is not JSON")):
        with pytest.raises(serve.EngineCliError, match=why):
            serve.disk_tier_config(p, "/kv", {serve.DISK_TIER_OPTIONS_ENV: bad})
