"""Kubernetes API access shared by both programs: configuration, errors, list and watch of pods.

The aggregator adds its writes on top (``aggregator.kube``); the DaemonSet agent uses only the
reads (its RBAC is list/watch pods). Only this package and ``aggregator.kube`` import the
``kubernetes`` client, and its errors are wrapped in :mod:`servehealth_common.kube.errors`.
"""
