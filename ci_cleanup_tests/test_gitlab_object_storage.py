"""gitlab.yml's object storage settings for artifacts, read as GitLab's ``ObjectStoreSettings`` reads them, and the
``CI_CLEANUP_ARTIFACTS_OBJECT_STORE_*`` variables; errors name the file and the key, never a secret."""

from __future__ import annotations

import pytest
import yaml

from ci_cleanup.gitlab.config_files import ConfigFileError
from ci_cleanup.gitlab.object_storage import (
    ENV_PREFIX,
    artifacts_object_store,
    from_environment,
    from_gitlab_yml,
)

SECRET = "never-shown-s3cr3t"
CONNECTION = {"provider": "AWS", "aws_access_key_id": "AKIAEXAMPLE", "aws_secret_access_key": SECRET,
              "region": "eu-central-1", "endpoint": "https://minio.example:9000", "path_style": True}


def write(folder, production: dict) -> None:
    (folder / "gitlab.yml").write_text(yaml.safe_dump({"production": production}))


def test_consolidated_form_takes_objects_artifacts_bucket_and_splits_its_prefix(tmp_path):
    write(tmp_path, {"object_store": {"enabled": True, "connection": CONNECTION,
                                      "objects": {"artifacts": {"bucket": "gitlab/ci/artifacts"},
                                                  "lfs": {"bucket": "lfs"}}}})
    store = from_gitlab_yml(tmp_path)
    assert (store.provider, store.bucket, store.prefix, store.endpoint, store.region, store.path_style) == (
        "AWS", "gitlab", "ci/artifacts", "https://minio.example:9000", "eu-central-1", True)
    assert store.key("ab/cd/abcd/2024_01_01/7/1", "artifacts.zip") == (
        "ci/artifacts/ab/cd/abcd/2024_01_01/7/1/artifacts.zip")
    assert store.source == f"{tmp_path}/gitlab.yml (production.object_store)"
    assert SECRET not in repr(store) and SECRET not in str(store.describe())


def test_per_type_form_takes_remote_directory(tmp_path):
    write(tmp_path, {"artifacts": {"enabled": True, "object_store": {
        "enabled": True, "remote_directory": "artifacts", "connection": {**CONNECTION, "path_style": "false"}}}})
    store = from_gitlab_yml(tmp_path)
    assert (store.bucket, store.prefix, store.path_style, store.access_key_id, store.secret_access_key) == (
        "artifacts", None, False, "AKIAEXAMPLE", SECRET)
    assert store.key("ab/cd", "a.zip") == "ab/cd/a.zip"


def test_a_type_with_its_own_different_connection_keeps_every_type_on_its_own_settings(tmp_path):
    """use_consolidated_settings?: an accelerated type (lfs here) with an enabled, different connection."""
    write(tmp_path, {
        "object_store": {"enabled": True, "connection": CONNECTION, "objects": {"artifacts": {"bucket": "common"}}},
        "lfs": {"object_store": {"enabled": True, "connection": {**CONNECTION, "region": "us-east-1"}}},
        "artifacts": {"object_store": {"enabled": True, "remote_directory": "own", "connection": CONNECTION}},
    })
    assert from_gitlab_yml(tmp_path).bucket == "own"


def test_consolidated_with_artifacts_disabled_among_its_objects_falls_back_to_the_artifacts_section(tmp_path):
    write(tmp_path, {"object_store": {"enabled": True, "connection": CONNECTION,
                                      "objects": {"artifacts": {"bucket": "common", "enabled": False}}}})
    assert from_gitlab_yml(tmp_path) is None


@pytest.mark.parametrize("production", [
    pytest.param({}, id="no settings"),
    pytest.param({"artifacts": {"enabled": False, "object_store": {"enabled": True, "remote_directory": "a",
                                                                   "connection": CONNECTION}}}, id="artifacts off"),
    pytest.param({"artifacts": {"object_store": {"enabled": False, "remote_directory": "a",
                                                 "connection": CONNECTION}}}, id="object store off"),
    pytest.param({"object_store": {"enabled": False, "connection": CONNECTION,
                                   "objects": {"artifacts": {"bucket": "a"}}}}, id="consolidated off"),
])
def test_local_storage_is_no_object_store(tmp_path, production):
    write(tmp_path, production)
    assert from_gitlab_yml(tmp_path) is None


def test_no_gitlab_yml_is_no_object_store(tmp_path):
    assert from_gitlab_yml(tmp_path) is None


def test_use_iam_profile_leaves_the_keys_to_the_default_chain(tmp_path):
    write(tmp_path, {"artifacts": {"object_store": {"enabled": True, "remote_directory": "a", "connection": {
        "provider": "AWS", "use_iam_profile": True, "region": "eu-west-1"}}}})
    store = from_gitlab_yml(tmp_path)
    assert (store.access_key_id, store.secret_access_key, store.endpoint) == (None, None, None)
    assert store.describe()["credentials"] == "default chain (instance profile, AWS_*)"


def test_host_without_endpoint_is_fogs_scheme_host_port(tmp_path):
    write(tmp_path, {"artifacts": {"object_store": {"enabled": True, "remote_directory": "a", "connection": {
        "provider": "AWS", "host": "ceph.internal", "port": 7480, "scheme": "http"}}}})
    assert from_gitlab_yml(tmp_path).endpoint == "http://ceph.internal:7480"


@pytest.mark.parametrize(("production", "expected"), [
    pytest.param({"object_store": {"enabled": True, "connection": CONNECTION, "objects": {}}},
                 "production.object_store.objects.artifacts.bucket is missing", id="consolidated without a bucket"),
    pytest.param({"artifacts": {"object_store": {"enabled": True, "connection": CONNECTION}}},
                 "production.artifacts.object_store.remote_directory is missing", id="no remote_directory"),
    pytest.param({"artifacts": {"object_store": {"enabled": True, "remote_directory": "b/../c",
                                                 "connection": CONNECTION}}},
                 "production.artifacts.object_store's bucket: invalid bucket", id="a prefix with .."),
    pytest.param({"artifacts": {"object_store": {"enabled": True, "remote_directory": "./b",
                                                 "connection": CONNECTION}}},
                 "production.artifacts.object_store's bucket: invalid bucket", id="a bucket of ./"),
    pytest.param({"artifacts": {"object_store": {"enabled": True, "remote_directory": "b",
                                                 "connection": {**CONNECTION, "aws_secret_access_key": [SECRET]}}}},
                 "production.artifacts.object_store.connection.aws_secret_access_key is a list", id="a list key"),
    pytest.param({"artifacts": "yes"}, "production.artifacts is not a mapping", id="not a mapping"),
])
def test_settings_that_cannot_be_used_are_one_line_naming_file_and_key_never_the_secret(tmp_path, production,
                                                                                         expected):
    write(tmp_path, production)
    with pytest.raises(ConfigFileError) as error:
        from_gitlab_yml(tmp_path)
    message = str(error.value)
    assert message.startswith(f"{tmp_path}/gitlab.yml: {expected}") and "\n" not in message
    assert SECRET not in message


def test_erb_in_gitlab_yml_is_refused_naming_its_key(tmp_path):
    (tmp_path / "gitlab.yml").write_text("production:\n  artifacts:\n    object_store:\n"
                                         "      remote_directory: <%= ENV['BUCKET'] %>\n")
    with pytest.raises(ConfigFileError, match="ERB at key remote_directory"):
        from_gitlab_yml(tmp_path)


def test_environment_variables_define_the_store_and_override_gitlab_yml(tmp_path):
    write(tmp_path, {"artifacts": {"object_store": {"enabled": True, "remote_directory": "from-file",
                                                    "connection": CONNECTION}}})
    env = {"CI_CLEANUP_GITLAB_CONFIG_DIR": str(tmp_path), ENV_PREFIX + "BUCKET": "from-env/pre",
           ENV_PREFIX + "ENDPOINT": "http://127.0.0.1:9000", ENV_PREFIX + "PATH_STYLE": "true"}
    store = artifacts_object_store(env)
    assert (store.provider, store.bucket, store.prefix, store.endpoint, store.path_style, store.access_key_id) == (
        "AWS", "from-env", "pre", "http://127.0.0.1:9000", True, None)
    assert artifacts_object_store({"CI_CLEANUP_GITLAB_CONFIG_DIR": str(tmp_path)}).bucket == "from-file"
    assert artifacts_object_store({}) is None


def test_an_object_store_variable_without_the_bucket_is_refused():
    with pytest.raises(ConfigFileError, match=f"^{ENV_PREFIX}SECRET_ACCESS_KEY is set but {ENV_PREFIX}BUCKET is not"):
        from_environment({ENV_PREFIX + "SECRET_ACCESS_KEY": SECRET})
