-- The tables GitLab's Ci::PendingBuild.upsert_from_build! (args_from_build) reads beside the build, to queue a
-- stop action as GitLab queues it (issue 67). ci_cleanup_dev.ddl.ddl appends this file to every release's
-- DDL (sql/versions/*.sql) and to structure.sql, and one of build_tags.sql (GitLab 17.3+) or taggings.sql.
-- project_ci_cd_settings, project_features: read verbatim in gitlabhq/gitlabhq db/structure.sql at commit
--   84f51c2a54ff1ef8f758e8c7086dada1fc801c29 (19.x; ~980k-988k of 2,930,484 chars), carried over to every
--   release: not re-read at the others' commits. The columns the jobs read (builds_access_level,
--   group_runners_enabled) are older than 16.0 (GitLab's BackfillCiQueuingTables, 14.x, reads them).
-- projects, namespaces: NOT VERBATIM. Their CREATE TABLE statements were not found in the pages of 84f51c2a read
--   (pg_dump places them out of the alphabetical run); these are the columns the jobs read and a row needs,
--   typed as GitLab's models use them (Project#shared_runners_enabled, #pending_delete, #namespace_id;
--   Namespace#traversal_ids). Keys and the project_id unique indexes below are GitLab's names.

CREATE TABLE namespaces (
    id bigint NOT NULL,
    name character varying NOT NULL,
    path character varying NOT NULL,
    owner_id bigint,
    created_at timestamp without time zone,
    updated_at timestamp without time zone,
    type character varying DEFAULT 'User'::character varying NOT NULL,
    parent_id bigint,
    traversal_ids bigint[] DEFAULT '{}'::bigint[] NOT NULL,
    organization_id bigint
);

CREATE SEQUENCE namespaces_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE namespaces_id_seq OWNED BY namespaces.id;

CREATE TABLE project_ci_cd_settings (
    id bigint NOT NULL,
    project_id bigint NOT NULL,
    group_runners_enabled boolean DEFAULT true NOT NULL,
    merge_pipelines_enabled boolean,
    default_git_depth integer,
    forward_deployment_enabled boolean,
    merge_trains_enabled boolean DEFAULT false,
    auto_rollback_enabled boolean DEFAULT false NOT NULL,
    keep_latest_artifact boolean DEFAULT true NOT NULL,
    job_token_scope_enabled boolean DEFAULT false NOT NULL,
    runner_token_expiration_interval integer,
    separated_caches boolean DEFAULT true NOT NULL,
    allow_fork_pipelines_to_run_in_parent_project boolean DEFAULT true NOT NULL,
    inbound_job_token_scope_enabled boolean DEFAULT true NOT NULL,
    forward_deployment_rollback_allowed boolean DEFAULT true NOT NULL,
    merge_trains_skip_train_allowed boolean DEFAULT false NOT NULL,
    restrict_pipeline_cancellation_role smallint DEFAULT 0 NOT NULL,
    pipeline_variables_minimum_override_role smallint DEFAULT 3 NOT NULL,
    push_repository_for_job_token_allowed boolean DEFAULT false NOT NULL,
    id_token_sub_claim_components character varying[] DEFAULT '{project_path,ref_type,ref}'::character varying[] NOT NULL,
    delete_pipelines_in_seconds integer,
    allow_composite_identities_to_run_pipelines boolean DEFAULT false NOT NULL,
    display_pipeline_variables boolean DEFAULT false NOT NULL,
    resource_group_default_process_mode smallint DEFAULT 0 NOT NULL,
    max_pipelines_per_merge_train smallint,
    cross_project_push_for_job_token_allowed boolean DEFAULT false NOT NULL,
    merge_train_enforcement smallint DEFAULT 0 NOT NULL,
    skip_branch_pipelines_for_mrs boolean DEFAULT false NOT NULL,
    push_pipelines_for_job_token_allowed boolean DEFAULT false NOT NULL
);

CREATE SEQUENCE project_ci_cd_settings_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE project_ci_cd_settings_id_seq OWNED BY project_ci_cd_settings.id;

CREATE TABLE project_features (
    id bigint NOT NULL,
    project_id bigint NOT NULL,
    merge_requests_access_level integer,
    issues_access_level integer,
    wiki_access_level integer,
    snippets_access_level integer DEFAULT 20 NOT NULL,
    builds_access_level integer,
    created_at timestamp without time zone,
    updated_at timestamp without time zone,
    repository_access_level integer DEFAULT 20 NOT NULL,
    pages_access_level integer NOT NULL,
    forking_access_level integer,
    metrics_dashboard_access_level integer,
    requirements_access_level integer DEFAULT 20 NOT NULL,
    operations_access_level integer DEFAULT 20 NOT NULL,
    analytics_access_level integer DEFAULT 20 NOT NULL,
    security_and_compliance_access_level integer DEFAULT 10 NOT NULL,
    container_registry_access_level integer DEFAULT 0 NOT NULL,
    package_registry_access_level integer DEFAULT 0 NOT NULL,
    monitor_access_level integer DEFAULT 20 NOT NULL,
    infrastructure_access_level integer DEFAULT 20 NOT NULL,
    feature_flags_access_level integer DEFAULT 20 NOT NULL,
    environments_access_level integer DEFAULT 20 NOT NULL,
    releases_access_level integer DEFAULT 20 NOT NULL,
    model_experiments_access_level integer NOT NULL,
    model_registry_access_level integer NOT NULL
);

CREATE SEQUENCE project_features_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE project_features_id_seq OWNED BY project_features.id;

CREATE TABLE projects (
    id bigint NOT NULL,
    name character varying,
    path character varying,
    created_at timestamp without time zone,
    updated_at timestamp without time zone,
    namespace_id bigint NOT NULL,
    shared_runners_enabled boolean DEFAULT true NOT NULL,
    pending_delete boolean DEFAULT false,
    project_namespace_id bigint,
    organization_id bigint
);

CREATE SEQUENCE projects_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE projects_id_seq OWNED BY projects.id;

ALTER TABLE ONLY namespaces ALTER COLUMN id SET DEFAULT nextval('namespaces_id_seq'::regclass);

ALTER TABLE ONLY project_ci_cd_settings ALTER COLUMN id SET DEFAULT nextval('project_ci_cd_settings_id_seq'::regclass);

ALTER TABLE ONLY project_features ALTER COLUMN id SET DEFAULT nextval('project_features_id_seq'::regclass);

ALTER TABLE ONLY projects ALTER COLUMN id SET DEFAULT nextval('projects_id_seq'::regclass);

ALTER TABLE ONLY namespaces
    ADD CONSTRAINT namespaces_pkey PRIMARY KEY (id);

ALTER TABLE ONLY project_ci_cd_settings
    ADD CONSTRAINT project_ci_cd_settings_pkey PRIMARY KEY (id);

ALTER TABLE ONLY project_features
    ADD CONSTRAINT project_features_pkey PRIMARY KEY (id);

ALTER TABLE ONLY projects
    ADD CONSTRAINT projects_pkey PRIMARY KEY (id);

CREATE UNIQUE INDEX index_project_ci_cd_settings_on_project_id ON project_ci_cd_settings USING btree (project_id);

CREATE UNIQUE INDEX index_project_features_on_project_id ON project_features USING btree (project_id);
