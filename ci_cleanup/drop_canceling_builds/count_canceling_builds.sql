-- How many builds are canceling and untouched for over an hour (the find op's count, a dry run's would_drop_count).
SELECT count(*)
FROM p_ci_builds
WHERE {{ outdated_canceling }}
