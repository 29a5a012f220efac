-- A build's tags from GitLab 17.3 on (Ci::BuildTag, Ci::Build#tags_ids): p_ci_build_tags. NOT VERBATIM: written
-- from GitLab's migration CreateTablePCiBuildTags (milestone '17.3': bigserial id, tag_id, build_id, partition_id,
-- project_id, all NOT NULL; PARTITION BY LIST (partition_id); primary key (id, partition_id); unique index
-- (tag_id, build_id, partition_id); index (build_id, partition_id), left out here as the vendored subsets leave out
-- non-unique indexes), its partitions as GitLab's partition manager makes them, one per builds partition.
-- Appended by ci_cleanup_dev.ddl.ddl to the releases from 17.x on.

CREATE TABLE p_ci_build_tags (
    id bigint NOT NULL,
    tag_id bigint NOT NULL,
    build_id bigint NOT NULL,
    partition_id bigint NOT NULL,
    project_id bigint NOT NULL
)
PARTITION BY LIST (partition_id);

CREATE SEQUENCE p_ci_build_tags_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE p_ci_build_tags_id_seq OWNED BY p_ci_build_tags.id;

ALTER TABLE ONLY p_ci_build_tags ALTER COLUMN id SET DEFAULT nextval('p_ci_build_tags_id_seq'::regclass);

ALTER TABLE ONLY p_ci_build_tags
    ADD CONSTRAINT p_ci_build_tags_pkey PRIMARY KEY (id, partition_id);

CREATE UNIQUE INDEX index_p_ci_build_tags_on_tag_id_and_build_id_and_partition_id ON ONLY p_ci_build_tags USING btree (tag_id, build_id, partition_id);

CREATE TABLE gitlab_partitions_dynamic.ci_build_tags_100 PARTITION OF p_ci_build_tags FOR VALUES IN ('100');

CREATE TABLE gitlab_partitions_dynamic.ci_build_tags_101 PARTITION OF p_ci_build_tags FOR VALUES IN ('101');

CREATE TABLE gitlab_partitions_dynamic.ci_build_tags_102 PARTITION OF p_ci_build_tags FOR VALUES IN ('102');
