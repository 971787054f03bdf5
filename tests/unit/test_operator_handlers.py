"""The kopf wiring's pure parts: settings from the environment, and which
InferenceDeployment a managed child's event re-reconciles."""

from __future__ import annotations

import kopf

from spillway_operator.handlers import OWNER_LABEL, configure, make_controller, owner_key
from spillway_operator.kube import Kube


def test_settings_come_from_the_environment():
    settings = kopf.OperatorSettings()
    configure(settings, {"SPILLWAY_WATCH_TIMEOUT": "60"})
    assert settings.posting.enabled is False
    assert (settings.watching.server_timeout, settings.watching.client_timeout) == (60, 90)
    assert settings.persistence.finalizer == "spillway.dev/operator"


def test_controller_sizing_comes_from_the_environment():
    c = make_controller(Kube(None), {"SPILLWAY_WORKERS": "2", "SPILLWAY_RESYNC_SECONDS": "7"})
    assert (c.workers, c.resync_seconds) == (2, 7.0) and c.autoscaler is not None


def test_a_child_names_its_owner_by_label():
    assert owner_key("team-a", {OWNER_LABEL: "chat"}) == ("team-a", "chat")
    assert owner_key("team-a", {}) is None
    assert owner_key(None, {OWNER_LABEL: "chat"}) is None
