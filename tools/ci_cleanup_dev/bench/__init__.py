"""Seeding at GitLab.com scale and the ``ci-cleanup bench`` benchmark."""
