-- A build's tags before GitLab 17.3 (acts-as-taggable-on on CommitStatus: Ci::Build#tag_ids through taggings,
-- taggable_type 'CommitStatus', context 'tags'). NOT VERBATIM: the columns acts-as-taggable-on's migration
-- creates, as GitLab's ci database has them (ids widened to bigint); its non-unique index (taggable_id,
-- taggable_type, context) left out, as the vendored subsets leave them out. Appended by
-- ci_cleanup_dev.ddl.ddl to 16.0's DDL and to the flat layout's.

CREATE TABLE taggings (
    id bigint NOT NULL,
    tag_id bigint,
    taggable_id bigint,
    taggable_type character varying,
    tagger_id bigint,
    tagger_type character varying,
    context character varying,
    created_at timestamp without time zone
);

CREATE SEQUENCE taggings_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE taggings_id_seq OWNED BY taggings.id;

ALTER TABLE ONLY taggings ALTER COLUMN id SET DEFAULT nextval('taggings_id_seq'::regclass);

ALTER TABLE ONLY taggings
    ADD CONSTRAINT taggings_pkey PRIMARY KEY (id);