"""Shared pytest configuration.

This directory holds no ``__init__.py``; pytest's default import mode puts it on ``sys.path``
because of this file, so test modules import shared helpers such as ``net_conformance`` directly.
"""
