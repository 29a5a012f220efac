"""GitLab's own files and the Redis stores' fallbacks, as GitLab reads them: no server needed.

database.yml → the main and ci SQLAlchemy URLs; resque.yml / redis.yml / redis.<store>.yml and the environment →
which settings each Redis use gets; a file that cannot be used → one line naming the file and key, no password.
"""

from __future__ import annotations

from urllib.parse import quote

import pytest
import yaml

from ci_cleanup.gitlab.config_files import ConfigFileError, database_urls
from ci_cleanup.gitlab.redis_stores import USES, StoreConfigError, resolve

SECRET = "S3cr:t@p/w?d#x"  # every character a URL would choke on, percent-encoded where it goes into one
OMNIBUS_MAIN = {
    "adapter": "postgresql", "encoding": "unicode", "collation": None, "database": "gitlabhq_production",
    "username": "gitlab", "password": None, "host": "/var/opt/gitlab/postgresql", "port": 5432, "socket": None,
    "sslmode": None, "sslcompression": 0, "sslrootcert": None, "load_balancing": {"hosts": []},
    "prepared_statements": False, "statement_limit": 1000, "connect_timeout": None, "database_tasks": True,
}


def write(folder, name: str, production: object) -> None:
    (folder / name).write_text(yaml.safe_dump({"production": production}))


# database.yml


def test_omnibus_two_entries_pointing_at_one_database_are_one_database(tmp_path):
    write(tmp_path, "database.yml", {"main": OMNIBUS_MAIN, "ci": {**OMNIBUS_MAIN, "database_tasks": False}})
    assert database_urls(tmp_path) == (
        "postgresql+psycopg2://gitlab@/gitlabhq_production?host=/var/opt/gitlab/postgresql&port=5432", None
    )


def test_a_decomposed_ci_database_gets_its_own_url_with_host_port_password_and_sslmode(tmp_path):
    main = {"adapter": "postgresql", "database": "gitlabhq_production", "username": "gitlab", "password": SECRET,
            "host": "db.internal", "port": 5433, "sslmode": "verify-full"}
    write(tmp_path, "database.yml", {"main": main, "ci": {**main, "database": "gitlabhq_production_ci"}})
    encoded = "S3cr%3At%40p%2Fw%3Fd%23x"
    assert database_urls(tmp_path) == (
        f"postgresql+psycopg2://gitlab:{encoded}@db.internal:5433/gitlabhq_production?sslmode=verify-full",
        f"postgresql+psycopg2://gitlab:{encoded}@db.internal:5433/gitlabhq_production_ci?sslmode=verify-full",
    )


def test_the_single_database_form_without_main_is_one_database(tmp_path):
    write(tmp_path, "database.yml", {"adapter": "postgresql", "database": "gitlabhq_production",
                                      "username": "git", "host": "localhost"})
    assert database_urls(tmp_path) == ("postgresql+psycopg2://git@localhost/gitlabhq_production", None)


def test_main_alone_is_one_database_and_a_socket_key_is_the_socket_folder(tmp_path):
    write(tmp_path, "database.yml", {"main": {"database": "gitlabhq_production", "socket": "/run/postgresql"}})
    assert database_urls(tmp_path) == ("postgresql+psycopg2:///gitlabhq_production?host=/run/postgresql", None)


def test_the_urls_parse_with_the_projects_own_rules_and_keep_the_password(tmp_path):
    from ci_cleanup.resources import database_url

    write(tmp_path, "database.yml", {"main": {"database": "gitlab", "username": "u", "password": SECRET,
                                              "host": "db", "port": 5432}})
    parsed = database_url(database_urls(tmp_path)[0])
    assert (parsed.username, parsed.password, parsed.host, parsed.port, parsed.database) == (
        "u", SECRET, "db", 5432, "gitlab")


def test_ci_without_database_tasks_naming_another_database_is_refused(tmp_path):
    main = {"database": "gitlabhq_production", "host": "db", "password": SECRET}
    write(tmp_path, "database.yml", {"main": main, "ci": {**main, "database": "other", "database_tasks": False}})
    with pytest.raises(ConfigFileError) as error:
        database_urls(tmp_path)
    assert str(error.value) == (
        f"{tmp_path}/database.yml: production.ci has database_tasks: false but names another database than "
        "production.main"
    )


BROKEN_FILES = {
    "ERB": ("production:\n  main:\n    database: gitlab\n    password: <%= ENV['DB_PASSWORD'] %>\n",
            "ERB at key password (line 4); GitLab renders it, ci_cleanup does not: write the value in the file, or "
            "set it in the environment instead"),
    "YAML that does not parse": (f"production:\n  main:\n    password: \"{SECRET}\n    host: [db\n",
                                 "YAML does not parse at"),
    "not a mapping": ("- production\n", "expected a mapping with a production: section, found a list"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_FILES))
def test_a_database_yml_that_cannot_be_used_is_one_line_naming_file_and_key_never_the_password(tmp_path, case):
    text, expected = BROKEN_FILES[case]
    (tmp_path / "database.yml").write_text(text)
    with pytest.raises(ConfigFileError) as error:
        database_urls(tmp_path)
    message = str(error.value)
    assert message.startswith(f"{tmp_path}/database.yml: {expected}") and "\n" not in message
    assert SECRET not in message and "DB_PASSWORD" not in message


def test_a_database_yml_that_is_a_folder_cannot_be_read(tmp_path):
    (tmp_path / "database.yml").mkdir()
    with pytest.raises(ConfigFileError) as error:
        database_urls(tmp_path)
    assert str(error.value) == f"{tmp_path}/database.yml: cannot be read (Is a directory)"


def test_a_missing_database_yml_is_named(tmp_path):
    with pytest.raises(ConfigFileError) as error:
        database_urls(tmp_path)
    assert str(error.value) == f"{tmp_path}/database.yml: does not exist"


# The Redis stores: GitLab's fallbacks, GitLab's file precedence, the environment over the files


def uses(env: dict, config_dir=None, overrides=None) -> dict[str, tuple[str, str]]:
    """Each use's (store, source)."""
    resolved = {use: resolve(store, env, config_dir, overrides) for use, store in USES.items()}
    return {use: (c.store, c.source) for use, c in resolved.items()}


def test_with_the_default_url_alone_every_use_falls_back_to_it():
    assert uses({"CI_CLEANUP_REDIS_URL": "redis://r:6379/0"}) == {
        "leases": ("default", "CI_CLEANUP_REDIS_URL"),
        "artifact_buckets": ("default", "CI_CLEANUP_REDIS_URL"),
        "sidekiq_status": ("default", "CI_CLEANUP_REDIS_URL"),
    }


def test_the_queues_url_stays_sidekiqs_and_each_store_falls_back_as_gitlabs_do():
    env = {"CI_CLEANUP_REDIS_URL": "redis://r/0", "CI_CLEANUP_REDIS_QUEUES_URL": "redis://q/0",
           "CI_CLEANUP_REDIS_SHARED_STATE_URL": "redis://s/0"}
    assert uses(env) == {
        "leases": ("shared_state", "CI_CLEANUP_REDIS_SHARED_STATE_URL"),  # cluster_shared_state → shared_state
        "artifact_buckets": ("shared_state", "CI_CLEANUP_REDIS_SHARED_STATE_URL"),
        "sidekiq_status": ("queues", "CI_CLEANUP_REDIS_QUEUES_URL"),  # queues_metadata → queues
    }
    env |= {"CI_CLEANUP_REDIS_CLUSTER_SHARED_STATE_URL": "redis://c/0",
            "CI_CLEANUP_REDIS_QUEUES_METADATA_URL": "redis://m/0"}
    assert uses(env) == {
        "leases": ("cluster_shared_state", "CI_CLEANUP_REDIS_CLUSTER_SHARED_STATE_URL"),
        "artifact_buckets": ("shared_state", "CI_CLEANUP_REDIS_SHARED_STATE_URL"),
        "sidekiq_status": ("queues_metadata", "CI_CLEANUP_REDIS_QUEUES_METADATA_URL"),
    }


def test_the_files_follow_gitlabs_precedence_store_by_store(tmp_path):
    d = tmp_path
    write(d, "resque.yml", "redis://resque/0")
    assert uses({}, d)["leases"] == ("default", f"{d}/resque.yml production")
    write(d, "redis.yml", {"shared_state": "redis://yml-shared/0", "queues": "redis://yml-queues/0"})
    assert uses({}, d) == {
        "leases": ("shared_state", f"{d}/redis.yml production.shared_state"),
        "artifact_buckets": ("shared_state", f"{d}/redis.yml production.shared_state"),
        "sidekiq_status": ("queues", f"{d}/redis.yml production.queues"),
    }
    # GitLab: the fallback's own file comes before the fallback's key in redis.yml
    write(d, "redis.shared_state.yml", "redis://file-shared/0")
    assert uses({}, d)["leases"] == ("shared_state", f"{d}/redis.shared_state.yml production")
    assert uses({}, d)["artifact_buckets"] == ("shared_state", f"{d}/redis.yml production.shared_state")
    write(d, "redis.cluster_shared_state.yml", "redis://file-cluster/0")
    assert uses({}, d)["leases"] == ("cluster_shared_state", f"{d}/redis.cluster_shared_state.yml production")
    write(d, "redis.yml", {"cluster_shared_state": "redis://yml-cluster/0", "queues_metadata": "redis://m/0"})
    assert uses({}, d) == {
        "leases": ("cluster_shared_state", f"{d}/redis.yml production.cluster_shared_state"),
        "artifact_buckets": ("shared_state", f"{d}/redis.shared_state.yml production"),
        "sidekiq_status": ("queues_metadata", f"{d}/redis.yml production.queues_metadata"),
    }


def test_the_environment_overrides_the_files_for_its_store_only(tmp_path):
    write(tmp_path, "resque.yml", "redis://resque/0")
    write(tmp_path, "redis.cluster_shared_state.yml", "redis://cluster/0")
    env = {"CI_CLEANUP_REDIS_URL": "redis://env/0", "CI_CLEANUP_REDIS_SHARED_STATE_URL": "redis://env-shared/0"}
    assert uses(env, tmp_path) == {
        "leases": ("cluster_shared_state", f"{tmp_path}/redis.cluster_shared_state.yml production"),
        "artifact_buckets": ("shared_state", "CI_CLEANUP_REDIS_SHARED_STATE_URL"),
        "sidekiq_status": ("default", "CI_CLEANUP_REDIS_URL"),
    }


def test_the_resources_own_url_fields_come_first():
    env = {"CI_CLEANUP_REDIS_URL": "redis://env/0"}
    assert uses(env, overrides={"default": "redis://field/0", "queues": "redis://q/0"})["sidekiq_status"] == (
        "queues", "CI_CLEANUP_REDIS_QUEUES_URL")
    assert resolve("shared_state", env, overrides={"default": "redis://field/0"}).url == "redis://field/0"


def test_sentinel_and_cluster_entries_as_gitlab_writes_them(tmp_path):
    write(tmp_path, "redis.shared_state.yml", {
        "url": f"redis://:{quote(SECRET, safe='')}@gitlab-redis/2",
        "sentinels": [{"host": "10.0.0.1", "port": 26379}, {"host": "10.0.0.2", "port": 26380}],
        "sentinel_password": "sentinel-secret",
    })
    write(tmp_path, "redis.cluster_shared_state.yml", {
        "password": SECRET, "cluster": ["redis://10.0.1.1:7000", {"host": "10.0.1.2", "port": 7001}]})
    sentinel = resolve("shared_state", {}, tmp_path)
    assert (sentinel.master_name, sentinel.sentinels, sentinel.db, sentinel.password, sentinel.sentinel_password) == (
        "gitlab-redis", (("10.0.0.1", 26379), ("10.0.0.2", 26380)), 2, SECRET, "sentinel-secret")
    assert sentinel.where == (f"GitLab's shared_state Redis ({tmp_path}/redis.shared_state.yml production, Sentinel) "
                              "at master gitlab-redis db 2 via sentinels 10.0.0.1:26379,10.0.0.2:26380")
    cluster = resolve("cluster_shared_state", {}, tmp_path)
    assert (cluster.cluster, cluster.password) == ((("10.0.1.1", 7000), ("10.0.1.2", 7001)), SECRET)
    assert cluster.where == (f"GitLab's cluster_shared_state Redis ({tmp_path}/redis.cluster_shared_state.yml "
                             "production, Cluster) at nodes 10.0.1.1:7000,10.0.1.2:7001")


def test_sentinel_and_cluster_from_the_environment():
    env = {"CI_CLEANUP_REDIS_URL": "redis://:pw@gitlab-redis/0", "CI_CLEANUP_REDIS_SENTINELS": "h1:26379,[::1]:26380",
           "CI_CLEANUP_REDIS_SENTINEL_PASSWORD": "sp",
           "CI_CLEANUP_REDIS_CLUSTER_SHARED_STATE_CLUSTER": "c1:7000,c2:7001",
           "CI_CLEANUP_REDIS_CLUSTER_SHARED_STATE_PASSWORD": "cp"}
    default = resolve("shared_state", env)
    assert (default.store, default.master_name, default.sentinels, default.password, default.sentinel_password) == (
        "default", "gitlab-redis", (("h1", 26379), ("::1", 26380)), "pw", "sp")
    assert default.shown() == "master gitlab-redis db 0 via sentinels h1:26379,[::1]:26380"
    leases = resolve("cluster_shared_state", env)
    assert (leases.source, leases.cluster, leases.password) == (
        "CI_CLEANUP_REDIS_CLUSTER_SHARED_STATE_CLUSTER", (("c1", 7000), ("c2", 7001)), "cp")


STORE_ERRORS = {
    "ERB in redis.yml": ("redis.yml", f"production:\n  shared_state:\n    url: <%= '{SECRET}' %>\n",
                         "{d}/redis.yml: ERB at key url (line 3); GitLab renders it, ci_cleanup does not: write the "
                         "value in the file, or set it in the environment instead"),
    "YAML that does not parse": ("resque.yml", f"production:\n  url: 'redis://:{SECRET}@r/0\n  sentinels: [\n",
                                 "{d}/resque.yml: YAML does not parse at "),
    "sentinels without hosts": ("redis.shared_state.yml", f"production:\n  url: redis://:{quote(SECRET, safe='')}@m/0"
                                "\n  sentinels:"
                                "\n    - port: 26379\n",
                                "{d}/redis.shared_state.yml production: sentinels[0] has no host"),
    "a command for the secrets": ("resque.yml", "production:\n  url: redis://r/0\n  config_command: /bin/secrets\n",
                                  "{d}/resque.yml production: config_command is not supported (it needs GitLab's "
                                  "Ruby to decrypt or run it); put the password in the file, or in the store's "
                                  "variables"),
}


@pytest.mark.parametrize("case", sorted(STORE_ERRORS))
def test_a_redis_file_that_cannot_be_used_is_one_line_naming_file_and_key(tmp_path, case):
    name, text, expected = STORE_ERRORS[case]
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigFileError) as error:
        resolve("cluster_shared_state", {}, tmp_path)
    message = str(error.value)
    assert message.startswith(expected.format(d=tmp_path)) and "\n" not in message
    assert SECRET not in message


def test_no_redis_anywhere_says_what_was_looked_for(tmp_path):
    with pytest.raises(StoreConfigError) as error:
        resolve("cluster_shared_state", {}, tmp_path)
    assert str(error.value) == (
        "No Redis for GitLab's cluster_shared_state store: none of CI_CLEANUP_REDIS_CLUSTER_SHARED_STATE_URL, "
        f"CI_CLEANUP_REDIS_SHARED_STATE_URL, CI_CLEANUP_REDIS_URL is set nor in {tmp_path}"
    )
