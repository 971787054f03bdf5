"""The disk tier's volume for ``bench.node_faults --faults disk``: a size-limited
filesystem both real nodes mount, and the engine's disk-tier counters.

An EmptyDir tier lives on the node's (here: this machine's shared) disk: the kubelet
would evict the pod at its ``sizeLimit``, or the disk would fill for everyone, before a
store failed. So the tier goes on a SharedPVC whose PersistentVolume is a hostPath over
a tmpfs of exactly the tier's size, mounted on this machine before the nodes start (each
node's mount namespace is a copy of the host's): full means ENOSPC, as a full NVMe
volume would answer, and freeing it is one ``rm``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from spillway_engine.seam import DISK_TIER_MOUNT

VOLUME = Path("/tmp/spillway-node-faults-kv")  # outside the bench's workdir, which is wiped
SIZE = "64Mi"  # the tmpfs and offload.disk.size: each of the 2 replicas keeps half
CLAIM = "kv-disk"
FILL = f"{DISK_TIER_MOUNT}/fault-fill"
#: The tier's counters the fault reads (summed over a pod's engines).
COUNTERS = {
    "spillway_disk_tier_write_failures_total": "failures",
    "spillway_disk_tier_stores_total": "stores",
    "spillway_disk_tier_stores_dropped_total": "dropped",
}


def mount() -> None:
    """A fresh tmpfs of SIZE on VOLUME, writable by the engine's user (1000)."""
    unmount()
    VOLUME.mkdir(parents=True, exist_ok=True)
    size = SIZE.removesuffix("Mi") + "m"
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "spillway-kv",
                    str(VOLUME)], check=True)


def unmount() -> None:
    if VOLUME.is_mount():
        subprocess.run(["umount", "-l", str(VOLUME)], check=False)


def objects(namespace: str) -> list[dict[str, Any]]:
    """The ReadWriteMany claim over VOLUME (a PersistentVolume bound to it by name)."""
    pv = f"{namespace}-{CLAIM}"[:63]
    return [
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
         "spec": {"capacity": {"storage": SIZE}, "accessModes": ["ReadWriteMany"],
                  "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                  "hostPath": {"path": str(VOLUME), "type": "Directory"},
                  "claimRef": {"namespace": namespace, "name": CLAIM}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
         "metadata": {"name": CLAIM, "namespace": namespace},
         "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": pv,
                  "resources": {"requests": {"storage": SIZE}}}},
    ]


def offload_disk() -> dict[str, str]:
    """spec.offload.disk over the claim."""
    return {"size": SIZE, "volume": "SharedPVC", "claimName": CLAIM}


def fill_command() -> str:
    """Run in an engine container: fill the volume to ENOSPC, say how full it is."""
    return (f"dd if=/dev/zero of={FILL} bs=64k 2>&1 | tail -1; "
            f"df -k {DISK_TIER_MOUNT} | tail -1")

