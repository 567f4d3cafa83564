# SPDX-License-Identifier: Apache-2.0
"""Benchmark clients and tools (`kdaserve bench ...`). Import-light: no torch."""
