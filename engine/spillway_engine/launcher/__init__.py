"""The GPU pod's process: ``spillway-engine serve`` (``serve``), the vLLM general plugin
it installs (``plugin``) and the start-up check that vLLM built the planned geometry
(``plan_check``)."""
